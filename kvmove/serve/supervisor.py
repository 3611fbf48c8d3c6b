"""The worker processes' lifecycle (``Supervisor``): launched at start, watched, started again
when they die, kept kvmove peers of each other, added and drained for the planner, retired,
and stopped with the router.

* **Watched**: a worker process that dies is seen within ``MONITOR_SECONDS`` (its process
  handle). What that means for its requests is the router's (``on_death``); here its peers
  forget it, and it is started again under its name (``restart``) with a new control identity
  and re-admitted once ready (its peers replace its old incarnation) — unless it was draining:
  then it is retired.
* **Peered** (disaggregated): every live decode worker is made a kvmove peer of every live
  prefill worker, whatever restarted meanwhile (``reconcile``, every ``RECONCILE_SECONDS``; a
  connect that fails is tried again next round).
* **Sized** (``--planner``): it is the planner's ``Pools``: ``add`` starts one more worker of a
  pool as any is started; ``drain`` takes the pool's least-loaded worker out, waits for its
  requests to finish (none is cut short), then shuts it down.

Where processes run is the launcher's business (``workers.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvmove.engine.role import Role
from kvmove.errors import KVMoveError, PeerError
from kvmove.serve.channel import Channel
from kvmove.serve.config import ServeConfig
from kvmove.serve.messages import Connect, Forget, Shutdown
from kvmove.serve.planner import PoolSample
from kvmove.serve.pool import WorkerPool
from kvmove.serve.server_metrics import ServerMetrics
from kvmove.serve.tasks import Tasks
from kvmove.serve.workers import Launcher, WorkerInfo, cpu_shares, end_process, worker_command

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

MONITOR_SECONDS = 0.1
RECONCILE_SECONDS = 0.1
CONNECT_SECONDS = 10.0
DRAIN_POLL_SECONDS = 0.02
STOP_SECONDS = 10.0  # a worker asked to exit has this long before it is terminated


class Supervisor:
    """Args:
        config: the server's options (which workers, ``restart``, ``start_timeout``...).
        pool: the workers, which it fills.
        launcher: where their processes run.
        channel: how it reaches them (shutdown, connect).
        metrics: its gauges and counters (alive, restarts).
        tasks: where it spawns a drain (the router's: cancelled when it stops).
        on_death: called with a worker whose process just died and its exit code, before it
            is started again: the router ends the requests it held.
    """

    def __init__(self, config: ServeConfig, pool: WorkerPool, launcher: Launcher,
                 channel: Channel, metrics: ServerMetrics, tasks: Tasks,
                 on_death: Callable[[WorkerInfo, int | None], None]) -> None:
        self.config, self.pool, self.launcher = config, pool, launcher
        self.channel, self.metrics, self.tasks = channel, metrics, tasks
        self.on_death = on_death
        self.stopping = False

    # --- start and stop --------------------------------------------------------------------

    def launch_all(self) -> None:
        """Starts every worker process of the configuration, each on its own cores when the
        launcher runs them here and there are enough (under Ray, its num_cpus places them)."""
        c = self.config
        pin = c.pin_cpus and self.launcher.local
        cpus = cpu_shares(len(c.roles())) if pin else [[] for _ in c.roles()]
        for (name, role), mine in zip(c.roles(), cpus):
            command = worker_command(c, name, role, mine, self.channel.address)
            self.pool.add(WorkerInfo(name, role, command, self.launcher)).start()

    async def wait_ready(self) -> None:
        """Returns once every worker is ready; raises when one exited or at the deadline."""
        deadline = time.monotonic() + self.config.start_timeout
        while not all(w.ready for w in self.pool.values()):
            dead = [w.name for w in self.pool.values() if not w.alive]
            if dead:
                raise KVMoveError(f"worker processes {dead} exited during start-up")
            if time.monotonic() > deadline:
                raise KVMoveError(f"workers not ready after {self.config.start_timeout:g} s: "
                                  f"{[w.name for w in self.pool.values() if not w.ready]}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Asks every worker to exit, then terminates, then kills what is left."""
        self.stopping = True
        for worker in self.pool.alive():
            self._shutdown(worker)
        deadline = time.monotonic() + STOP_SECONDS
        for worker in self.pool.values():
            if worker.process is not None:
                await end_process(worker.process, deadline)

    def _shutdown(self, worker: WorkerInfo) -> None:
        self._send(worker, Shutdown())

    def _send(self, worker: WorkerInfo, command: Shutdown | Forget) -> None:
        try:
            self.channel.send(worker, command)
        except PeerError:
            pass  # gone already: its process is ended (or seen dead) by the monitor

    # --- watch -----------------------------------------------------------------------------

    async def monitor(self) -> None:
        """A dead worker process: ``/health`` shows it, its requests end with an error (and
        their other workers are told), and it is started again (``restart``)."""
        while True:
            for worker in self.pool.values():
                self.metrics.alive.labels(worker=worker.name).set(int(worker.alive))
                if worker.alive and worker.process.poll() is not None:
                    self._on_death(worker)
            await asyncio.sleep(MONITOR_SECONDS)

    def _on_death(self, worker: WorkerInfo) -> None:
        worker.alive = False
        code = worker.process.returncode
        logger.log(logging.INFO if self.stopping or worker.draining else logging.WARNING,
                   "worker %s (pid %s) exited with code %s", worker.name, worker.pid, code)
        self.on_death(worker, code)
        self.channel.fail(worker.name)
        for other in self.pool.values():
            other.peers = {p for p in other.peers if p[0] != worker.name}
        # its peers stop trying to reach its old address: the soak saw a decode worker's loop
        # spend 2 s a command on it while the router's Connect to the new run waited behind
        for other in self.pool.alive():
            if other.role != worker.role:
                self._send(other, Forget(peer=worker.name))
        self.pool.update_ready()
        if worker.draining:  # the planner ended it (or it died draining): not started again
            self._retire(worker)
        elif self.config.restart and not self.stopping:
            self.metrics.restarts.labels(worker=worker.name).inc()
            worker.restarts += 1
            worker.start()

    def _retire(self, worker: WorkerInfo) -> None:
        worker.retired = True
        logger.info("worker %s (pid %s) retired", worker.name, worker.pid)

    # --- peers (disaggregated) -------------------------------------------------------------

    async def reconcile(self) -> None:
        """Keeps every live decode worker a kvmove peer of every live prefill worker, whatever
        restarted meanwhile (a connect that fails is tried again)."""
        while True:
            for decode in self.pool.members(Role.DECODE):
                for prefill in self.pool.members(Role.PREFILL):
                    if not (decode.listening and prefill.listening) or \
                            (prefill.name, prefill.pid) in decode.peers:
                        continue
                    try:
                        await self._connect(decode, prefill)
                    except (TimeoutError, KVMoveError):
                        continue  # one of them died meanwhile: the next round sees it
            self.pool.update_ready()
            await asyncio.sleep(RECONCILE_SECONDS)

    async def _connect(self, decode: WorkerInfo, prefill: WorkerInfo) -> None:
        """Makes the two workers kvmove peers of each other: the decode worker exchanges
        metadata with the prefill worker's agent (a restarted one replaces its old self)."""
        decode_pid, prefill_pid = decode.pid, prefill.pid
        assert prefill.agent is not None
        future = self.channel.expect(decode.name, "connect")
        self.channel.send(decode, Connect(host=prefill.agent[0], port=prefill.agent[1]))
        if await asyncio.wait_for(future, CONNECT_SECONDS) is None:
            raise KVMoveError(f"{decode.name} could not connect to {prefill.name}")
        if decode.pid == decode_pid and prefill.pid == prefill_pid:  # both still the same
            decode.peers.add((prefill.name, prefill_pid))
            prefill.peers.add((decode.name, decode_pid))

    # --- the planner's Pools (planner.py decides) ------------------------------------------

    def sample(self, pool: Role) -> PoolSample:
        return self.pool.sample(pool)

    def add(self, pool: Role) -> WorkerInfo:
        """Starts one more worker of ``pool``, as any is started; it takes requests once ready
        (disaggregated: once a peer of the other pool). Refused once the server stops: a
        worker started then would outlive it."""
        if self.stopping:
            raise KVMoveError(f"no {pool} worker is added: the server is stopping")
        name = self.pool.next_name(pool)
        command = worker_command(self.config, name, pool, [], self.channel.address)
        worker = self.pool.add(WorkerInfo(name, pool, command, self.launcher))
        worker.start()
        return worker

    def drain(self, pool: Role) -> WorkerInfo | None:
        """Takes the least-loaded worker of ``pool`` out: no request is placed on it from
        now, those it holds finish (none is dropped), then it is shut down and not started
        again. None when the pool has no worker to spare."""
        worker = self.pool.to_drain(pool)
        if worker is None:
            return None
        worker.draining = True
        self.pool.update_ready()
        logger.info("draining %s: %d requests in flight", worker.name, worker.load)
        self.tasks.spawn(self._finish_drain(worker))
        return worker

    async def _finish_drain(self, worker: WorkerInfo) -> None:
        """Waits for its requests (and reservations) to end, then shuts it down. A request is
        never cut short for this: past ``request_timeout`` it says so, and waits on."""
        warn_at = time.monotonic() + self.config.request_timeout
        while worker.alive and (worker.requests or self.channel.awaits(worker.name)):
            if time.monotonic() > warn_at:
                logger.warning("%s still drains %d requests", worker.name, worker.load)
                warn_at += self.config.request_timeout
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if worker.alive:
            logger.info("%s drained: shutting it down", worker.name)
            self._shutdown(worker)
            await end_process(worker.process, time.monotonic() + STOP_SECONDS)
