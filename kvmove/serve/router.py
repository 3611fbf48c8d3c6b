"""The router: places each request on the worker processes, and turns their events into the
request's tokens and end. Placement:

* ``colocated`` / ``chunked``: the worker ``--routing`` picks (``routing.py``; kv: where the
  prompt's prefix is cached, traded off against its queue; least-loaded: the fewest queued +
  running requests).
* ``disagg``: the prefill worker is picked likewise; the decode worker with the most free
  blocks reserves the request's blocks, leases them to it and offers it the lease by kvmove
  (none free: the request waits in the decode queue and asks again; never dropped); the
  prefill worker gets the prompt and which decode worker its KV goes to. Prefill streams the
  KV layer by layer into the offered blocks (kvmove, not this router), decode generates, and
  its tokens come back through here.

Every end of a request is forwarded to every worker that holds it: a client that went away, a
worker that ended it (a decode whose lease expired, a prefill whose stream failed) or died
(the others keep being served). Beside it, one job each: ``pool.py`` (the workers),
``supervisor.py`` (their processes), ``channel.py`` (commands out, events in).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import Any

import zmq
import zmq.asyncio

from kvmove.engine.request import SamplingParams
from kvmove.engine.role import Role
from kvmove.errors import KVMoveError, PeerError
from kvmove.serve.channel import Channel
from kvmove.serve.config import Mode, ServeConfig
from kvmove.serve.control import ControlEndpoint
from kvmove.serve.handle import Handle
from kvmove.serve.kv_index import Decision
from kvmove.serve.messages import (
    Abort,
    Add,
    Connected,
    Ended,
    Event,
    Failed,
    KVEvents,
    Ready,
    Reserve,
    Reserved,
    Stats,
    Tokens,
)
from kvmove.serve.planner import Planner
from kvmove.serve.pool import WorkerPool
from kvmove.serve.routing import Routing
from kvmove.serve.server_metrics import ServerMetrics
from kvmove.serve.supervisor import Supervisor
from kvmove.serve.tasks import Tasks
from kvmove.serve.workers import WorkerInfo, launcher_for

__all__ = ["Handle", "Router"]

logger = logging.getLogger(__name__)

RESERVE_RETRY_SECONDS = 0.02


class Router:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.pool = WorkerPool(config)
        self.metrics = ServerMetrics(self.pool)
        self.routing = Routing(config, self.metrics)
        self.handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self.tasks = Tasks("router")
        self._stopped = False
        self.launcher = launcher_for(config)  # where worker processes run (--ray: Ray actors)
        self.context = zmq.asyncio.Context()
        self.control = ControlEndpoint(self.context, self.launcher.control_host)
        self.socket = self.control.socket
        self.channel = Channel(self.socket, self.control.address, self.pool,
                               self.metrics.control_dropped, self._on_event)
        self.supervisor = Supervisor(config, self.pool, self.launcher, self.channel,
                                     self.metrics, self.tasks, self._on_death)
        self.planner = Planner(self.supervisor, config.bounds(), config.planner_interval,
                               self.metrics.planner)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawns every worker process and returns once all are ready (and, disaggregated,
        every decode worker is a kvmove peer of every prefill worker). On failure every
        process it started is stopped again."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.supervisor.launch_all()
        self.tasks.loop("receive", self.channel.receive())
        self.tasks.loop("monitor", self.supervisor.monitor())
        if self.config.mode == Mode.DISAGG:
            self.tasks.loop("reconcile", self.supervisor.reconcile())
        await self.supervisor.wait_ready()
        if self.config.planner:
            self.tasks.loop("planner", self.planner.run())

    async def stop(self) -> None:
        """Asks every worker to exit, then terminates, then kills what is left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # the planner first: while workers exit, their pools look short of workers, and a
        # worker it started then would be left running (CI saw one)
        self.tasks.cancel_loop("planner")
        await self.supervisor.stop()
        self.tasks.cancel()
        for handle in list(self.handles.values()):
            self._end(handle, "abort", "", "the server is shutting down")
        self.control.close()
        self.context.term()
        self.launcher.close()

    # --- requests -------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams) -> Handle:
        handle = Handle(f"req-{next(self._ids)}", prompt, params)
        self.handles[handle.rid] = handle
        self.tasks.spawn(self._place(handle))
        return handle

    async def _place(self, handle: Handle) -> None:
        try:
            for role in self.config.pools():
                await self._wait_for_pool(handle, role)
            if handle.done:
                return
            if self.config.mode == Mode.DISAGG:
                await self._place_disaggregated(handle)
            else:
                worker, decision = self._route(handle, Role.COLOCATED)
                self.routing.record(handle, decision)
                self._assign(handle, worker)
                self.channel.send(worker, Add(rid=handle.rid, prompt=handle.prompt,
                                              params=handle.params))
        except Exception as error:  # noqa: BLE001 - no worker left, or the control plane failed
            self._end(handle, "abort", "", f"{type(error).__name__}: {error}")
        finally:
            self.routing.release(handle)

    async def _place_disaggregated(self, handle: Handle) -> None:
        waiting = False
        try:
            while True:
                prefill, decision = self._route(handle, Role.PREFILL)
                decode = max(self._alive(Role.DECODE), key=lambda w: (w.free_blocks, -w.load))
                future = self.channel.expect(decode.name, handle.rid)
                self.channel.send(decode, Reserve(rid=handle.rid, prompt=handle.prompt,
                                                  params=handle.params, peer=prefill.name))
                blocks = math.ceil(len(handle.prompt) / self.config.block_size)
                decode.asked_blocks[handle.rid] = blocks
                try:
                    lease = await asyncio.wait_for(future, self.config.request_timeout)
                finally:
                    decode.asked_blocks.pop(handle.rid, None)
                if handle.done:
                    if lease:
                        self.channel.send(decode, Abort(rid=handle.rid))
                    return
                if lease:
                    break
                if not waiting:
                    waiting = True
                    self.pool.waiting_for_blocks += 1
                await asyncio.sleep(RESERVE_RETRY_SECONDS)
        finally:
            if waiting:
                self.pool.waiting_for_blocks -= 1
        self._assign(handle, decode)
        if not prefill.alive:  # it died while the blocks were reserved
            self.abort(handle, f"worker {prefill.name} died")
            return
        self.routing.record(handle, decision)
        self._assign(handle, prefill)
        self.channel.send(prefill, Add(rid=handle.rid, prompt=handle.prompt,
                                       params=handle.params, decode_peer=decode.name))

    async def _wait_for_pool(self, handle: Handle, role: Role) -> None:
        """Returns once a worker of ``role`` takes requests. While every one of them is being
        started again (``restart``), the request waits for it, within its deadline; with none
        coming back it fails at once (``_alive`` raises)."""
        deadline = handle.arrival + self.config.request_timeout
        while not handle.done and not self.pool.ready(role):
            if not self.pool.alive(role):
                return  # nobody is coming back: placement fails, naming the pool
            if time.monotonic() > deadline:
                raise KVMoveError(f"no {role} worker took requests within "
                                  f"{self.config.request_timeout:g} s (being restarted)")
            await asyncio.sleep(RESERVE_RETRY_SECONDS)

    def _alive(self, role: Role) -> list[WorkerInfo]:
        workers = self.pool.ready(role)
        if not workers:
            raise KVMoveError(f"no {role} worker is alive")
        return workers

    def _route(self, handle: Handle, role: Role) -> tuple[WorkerInfo, Decision]:
        return self.routing.pick(handle, self._alive(role), self.handles)

    def _assign(self, handle: Handle, worker: WorkerInfo) -> None:
        handle.workers.append(worker.name)
        worker.requests.add(handle.rid)

    def abort(self, handle: Handle, reason: str, skip: str | None = None) -> None:
        """Ends a request for its client, and has its workers (but ``skip``, which ended it
        itself) drop it: its batch slot and blocks go back, a KV hand-off in flight is aborted
        (the prefill's stream) or cancelled (the decode's lease)."""
        workers = [name for name in handle.workers if name != skip]
        self._end(handle, "abort", "", reason)
        for name in workers:
            worker = self.pool[name]
            if worker.alive:
                try:
                    self.channel.send(worker, Abort(rid=handle.rid))
                except PeerError:
                    pass  # gone: the monitor will notice

    def abort_all(self, reason: str) -> None:
        for handle in list(self.handles.values()):
            self.abort(handle, reason)

    def _end(self, handle: Handle, reason: str, text: str, error: str | None) -> None:
        if handle.done:
            return
        handle.done = True
        self.handles.pop(handle.rid, None)
        for name in handle.workers:
            self.pool[name].requests.discard(handle.rid)
        self.metrics.requests.labels(outcome="error" if reason == "abort" else reason).inc()
        handle.events.put_nowait(("end", reason, text, error))

    def _on_death(self, worker: WorkerInfo, code: int | None) -> None:
        """The supervisor saw ``worker``'s process die: its requests end with an error (their
        other workers are told), and its cache is gone from the routing's index."""
        self.routing.forget(worker)
        for rid in list(worker.requests):
            handle = self.handles.get(rid)
            if handle is not None:
                self.abort(handle, f"worker {worker.name} died (exit code {code})",
                           skip=worker.name)
        worker.requests.clear()

    # --- events from workers --------------------------------------------------------------

    def _on_event(self, worker: WorkerInfo, event: Event) -> None:
        match event:
            case Ready():
                self.routing.forget(worker)  # a new process: its cache starts empty
                worker.agent, worker.registered = event.agent, True
                self.pool.update_ready()
            case Stats():
                worker.reported(event)
                self.metrics.observe_pools(self.pool)
            case Connected():
                self.channel.resolve(worker.name, "connect", event.peer)
            case Reserved():
                worker.asked_blocks.pop(event.rid, None)
                worker.granted_blocks += event.num_blocks or 0
                self.channel.resolve(worker.name, event.rid, event if event.num_blocks else None)
            case Tokens():
                self._on_tokens(worker, event)
            case Ended():
                self._on_ended(worker, event)
            case KVEvents():
                self.routing.on_events(worker, event)
            case Failed():
                self.metrics.commands_refused.labels(worker=worker.name).inc()
                logger.warning("%s refused a %s command: %s", worker.name, event.op,
                               event.error)

    def _on_tokens(self, worker: WorkerInfo, event: Tokens) -> None:
        """Tokens for the worker's own requests (a token of an ended one is late: skipped)."""
        now = time.monotonic()
        for rid, token in event.items:
            handle = self.handles.get(rid)
            if handle is None or rid not in worker.requests:
                continue
            if handle.last_token is None:
                handle.ttft = now - handle.arrival
                self.metrics.ttft.observe(handle.ttft)
            else:
                self.metrics.itl.observe(now - handle.last_token)
            handle.last_token = now
            handle.num_tokens += 1
            self.metrics.tokens.inc()
            handle.events.put_nowait(("token", token))

    def _on_ended(self, worker: WorkerInfo, event: Ended) -> None:
        rid = event.rid
        holds = rid in worker.requests or self.channel.awaits(worker.name, rid)
        self.channel.resolve(worker.name, rid, None)  # a failed reserve
        handle = self.handles.get(rid)
        worker.requests.discard(rid)
        if event.reason == "handed_off":
            self.metrics.observe_handed_off(event)
            return
        if handle is None or not holds:
            return
        self.metrics.observe_handoff(event.timeline, handle.ttft)
        if event.reason == "abort":
            # The other workers of the request are told: a decode whose lease ended cancels
            # the prefill's stream, a prefill whose stream failed frees the decode's lease.
            self.abort(handle, f"{worker.name}: {event.error or 'request aborted'}",
                       skip=worker.name)
            return
        self._end(handle, event.reason, event.text, event.error)

    def health(self) -> dict[str, Any]:
        """``/health``: the workers' (``WorkerPool.health``), down while one of the router's
        loops has ended (each runs until the router stops)."""
        report = self.pool.health()
        ended = "" if self._stopped else self.tasks.ended()
        if ended:  # a router that no longer hears its workers serves nobody
            report.update(status="down", error=f"the router's {ended} ended")
        return report
