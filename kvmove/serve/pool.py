"""The router's workers, by name (``WorkerPool``): the one place that says which of them have a
role, live, take requests or drain, and what a pool amounts to (its sample for the planner,
its queue, the worker it would give up, its health).

A worker's flags (``WorkerInfo``), set by the supervisor and the router's events:

* ``alive``: its process runs (a dead one is started again under its name, unless retired);
* ``registered``: its current process's ``ready`` event came (its agent listens);
* ``ready``: it takes requests: registered and not draining, and, disaggregated, a kvmove peer
  of every registered worker of the other pool (``update_ready``);
* ``draining``: the planner takes it out: no new requests, its own finish, then it ends;
* ``retired``: it drained and ended: never started again, no longer reported.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from kvmove.engine.role import Role
from kvmove.errors import KVMoveError
from kvmove.serve.config import Mode, ServeConfig
from kvmove.serve.planner import PoolSample
from kvmove.serve.workers import WorkerInfo

__all__ = ["WorkerPool"]


class WorkerPool(Mapping[str, WorkerInfo]):
    """Every worker the router has had, by name (retired ones too), in the order they joined.

    ``waiting_for_blocks``: disaggregated requests the router holds back until a decode worker
    has blocks for them (``Router``'s placement counts them): part of the decode pool's queue,
    though no worker holds them yet.
    """

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._workers: dict[str, WorkerInfo] = {}
        self.waiting_for_blocks = 0

    def __getitem__(self, name: str) -> WorkerInfo:
        return self._workers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def add(self, worker: WorkerInfo) -> WorkerInfo:
        """``worker`` joins the pool (not started: the supervisor starts it).

        Raises:
            KVMoveError: a worker of its name is in the pool already.
        """
        if worker.name in self._workers:
            raise KVMoveError(f"a worker named {worker.name!r} is in the pool already")
        self._workers[worker.name] = worker
        return worker

    def next_name(self, role: Role) -> str:
        """``<role>-<N>``, the lowest N no worker has had (a retired one keeps its name)."""
        index = next(i for i in itertools.count() if f"{role}-{i}" not in self._workers)
        return f"{role}-{index}"

    # --- who: the filters -------------------------------------------------------------------

    def members(self, role: Role | None = None) -> list[WorkerInfo]:
        """Every worker (of ``role``), retired ones too."""
        return [w for w in self._workers.values() if role is None or w.role == role]

    def alive(self, role: Role | None = None) -> list[WorkerInfo]:
        return [w for w in self.members(role) if w.alive]

    def ready(self, role: Role) -> list[WorkerInfo]:
        """Those a request can be placed on now."""
        return [w for w in self.members(role) if w.alive and w.ready]

    def active(self, role: Role) -> list[WorkerInfo]:
        """Those taking requests or starting: alive and not draining (the planner's pool)."""
        return [w for w in self.members(role) if w.alive and not w.draining]

    def current(self) -> list[WorkerInfo]:
        """Those ``/health`` reports: all but the retired."""
        return [w for w in self._workers.values() if not w.retired]

    def identify(self, identity: bytes) -> WorkerInfo | None:
        """The live worker whose current process has ``identity`` on the control channel
        (None: no live process's, e.g. a dead one's last words)."""
        return next((w for w in self._workers.values() if w.alive and w.identity == identity),
                    None)

    def update_ready(self) -> None:
        """Sets every worker's ``ready`` from its flags and peers (see the module)."""
        disagg = self.config.mode == Mode.DISAGG
        for w in self._workers.values():
            if not w.listening or w.draining:
                w.ready = False
            elif not disagg:
                w.ready = True
            else:
                others = [(o.name, o.pid) for o in self._workers.values()
                          if o.role != w.role and o.listening]
                w.ready = all(other in w.peers for other in others)

    # --- how much: what the planner, the gauges and /health read ----------------------------

    def sample(self, role: Role) -> PoolSample:
        """``role``'s pool now, from its workers' last stats: those taking requests (or
        starting), what waits on them (decode: for a batch slot or blocks) and runs."""
        members = self.active(role)
        waiting = sum(w.stat("waiting") for w in members)
        utilisation = 0.0
        if role == Role.DECODE:
            waiting += self.waiting_for_blocks
            c = self.config
            used = [max(1 - w.stat("free_blocks") / c.num_blocks, w.stat("running") /
                        c.max_num_seqs) for w in members if w.stats is not None]
            utilisation = sum(used) / len(used) if used else 0.0
        return PoolSample(len(members), waiting, sum(w.stat("running") for w in members),
                          utilisation, self.config.max_num_seqs)

    def queue(self, role: Role) -> int:
        """Requests waiting on the pool's live workers (decode: also for blocks to land in)."""
        queue = sum(w.stat("waiting") + w.stat("loading") for w in self.alive(role))
        return queue + (self.waiting_for_blocks if role == Role.DECODE else 0)

    def running(self, role: Role) -> int:
        return sum(w.stat("running") for w in self.alive(role))

    def to_drain(self, role: Role) -> WorkerInfo | None:
        """The worker of ``role`` the planner would give up: the least loaded of those taking
        requests; None when fewer than two do."""
        members = self.active(role)
        if len(members) < 2:
            return None
        return min(members, key=lambda w: (w.load, w.stat("waiting")))

    def health(self) -> dict[str, Any]:
        """``/health``'s status (ok: every current worker alive and connected to every peer it
        had; degraded: each role still has a live worker; down) and its workers."""
        current = self.current()
        workers = [{"name": w.name, "role": w.role, "alive": w.alive, "ready": w.ready,
                    "draining": w.draining, "pid": w.pid, "node": w.node,
                    **(w.stats.model_dump(exclude={"ev"}) if w.stats else {})}
                   for w in current]
        # a retired worker is never alive: alive(role) holds only current ones
        serving = all(self.alive(role) for role in {w.role for w in current})
        # a peer lost is one that lives and cannot be reached (a dead one is counted dead)
        live = {w.name for w in current if w.alive}
        everyone = all(w.alive and not (w.stats and live.intersection(w.stats.lost_peers))
                       for w in current)
        status = "ok" if everyone else ("degraded" if serving else "down")
        return {"status": status, "mode": self.config.mode, "workers": workers}
