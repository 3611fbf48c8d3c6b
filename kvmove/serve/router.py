"""The router: request placement over the worker processes, and their events.

Every worker process (``worker_main``) connects a DEALER socket to the router's ROUTER socket
(``control.py``: a private ipc socket, an identity per process, bounded messages; every
message parsed by ``messages.py``). Placement:

* ``colocated`` / ``chunked``: the worker ``--routing`` picks (``routing.py``; kv: where the
  prompt's prefix is cached, traded off against its queue; least-loaded: the fewest queued +
  running requests).
* ``disagg``: the prefill worker is picked likewise; the decode worker with
  the most free blocks reserves the request's blocks and leases them to it (none free: the
  request waits in the decode queue and asks again; never dropped); the prefill worker gets
  the prompt, where its KV goes and the lease's epoch. Prefill streams the KV layer by layer
  into the leased blocks (kvmove, not this router), decode generates, and its tokens come back
  through here.

Every end of a request is forwarded to every worker that holds it: a client that went away, a
worker that ended it (a decode whose lease expired, a prefill whose stream failed) or died.
A worker process that dies is seen within ~0.1 s (its process handle): ``/health`` reports
it, its requests end with an error event, and the others keep being served; it is started
again under its name and re-admitted once ready (its peers replace its old incarnation).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine
from typing import Any

import zmq
import zmq.asyncio

from kvmove.engine.request import SamplingParams
from kvmove.errors import KVMoveError, PeerError
from kvmove.serve.config import MODES, ServeConfig
from kvmove.serve.control import ControlEndpoint
from kvmove.serve.messages import (
    Abort, Add, Connect, Connected, Ended, Event, Failed, KVEvents, Ready, Reserve, Reserved,
    Shutdown, Stats, Tokens, encode, parse_event)
from kvmove.serve.kv_index import Decision
from kvmove.serve.metrics import Metrics
from kvmove.serve.planner import Planner, PoolSample
from kvmove.serve.routing import Routing
from kvmove.serve.workers import (
    WorkerInfo, cpu_shares, end_process, launcher_for, worker_command)

__all__ = ["MODES", "Handle", "Router", "ServeConfig", "WorkerInfo"]

logger = logging.getLogger(__name__)

MONITOR_SECONDS = 0.1
RESERVE_RETRY_SECONDS = 0.02
RECONCILE_SECONDS = 0.1
CONNECT_SECONDS = 10.0
LOUD_DROPS = 10  # dropped control messages logged as warnings (of each reason), then debug


class Handle:
    """One client request: its tokens arrive in ``events`` as ("token", id) and one
    ("end", reason, text, error)."""

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.rid, self.prompt, self.params = rid, prompt, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.num_tokens = 0
        self.workers: list[str] = []
        self.done = False
        self.ttft: float | None = None
        self.uncached = 0  # prompt tokens its prefill worker computes, as routing estimated
        self.hashes: list[int] = []  # its prompt's prefix blocks (routing.py)


class Router:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerInfo] = {}
        self.metrics = Metrics(self.workers)
        self.routing = Routing(config, self.metrics)
        self.planner = Planner(self, config.bounds(), config.planner_interval)
        self.handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self._futures: dict[tuple[str, str], asyncio.Future] = {}
        self._waiting_for_blocks = 0
        self._tasks: set[asyncio.Task] = set()  # running ones only: each drops itself
        self._loops: dict[str, asyncio.Task] = {}  # the router's own: never meant to end
        self._identities: dict[bytes, WorkerInfo] = {}  # live worker processes only
        self._drops: dict[str, int] = {}  # control messages dropped, by reason
        self._stopped = False
        self.launcher = launcher_for(config)  # where worker processes run (--ray: Ray actors)
        self.context = zmq.asyncio.Context()
        self.control = ControlEndpoint(self.context, self.launcher.control_host)
        self.socket = self.control.socket

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
        c = self.config
        pin = c.pin_cpus and self.launcher.local  # under Ray, its num_cpus places workers
        cpus = cpu_shares(len(c.roles())) if pin else [[] for _ in c.roles()]
        for (name, role), mine in zip(c.roles(), cpus):
            command = worker_command(c, name, role, mine, self.control.address)
            self.workers[name] = WorkerInfo(name, role, command, self.launcher)
            self._launch(self.workers[name])
        self._loop("receive", self._receive())
        self._loop("monitor", self._monitor())
        if c.mode == "disagg":
            self._loop("reconcile", self._reconcile())
        deadline = time.monotonic() + c.start_timeout
        while not all(w.ready for w in self.workers.values()):
            dead = [w.name for w in self.workers.values() if not w.alive]
            if dead:
                raise KVMoveError(f"worker processes {dead} exited during start-up")
            if time.monotonic() > deadline:
                raise KVMoveError(f"workers not ready after {c.start_timeout:g} s: "
                                  f"{[w.name for w in self.workers.values() if not w.ready]}")
            await asyncio.sleep(0.05)
        if c.planner:
            self._loop("planner", self.planner.run())

    def _launch(self, worker: WorkerInfo) -> None:
        """Starts the worker's process; only its new identity is heard from then on."""
        self._identities.pop(worker.identity, None)
        worker.start()
        self._identities[worker.identity] = worker

    def _loop(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        self._loops[name] = asyncio.create_task(work, name=f"router-{name}")

    def _mark_ready(self) -> None:
        """A worker takes requests once registered and, disaggregated, a kvmove peer of every
        registered worker of the other pool (each one's current incarnation)."""
        for w in self.workers.values():
            if not (w.alive and w.registered) or w.draining:
                w.ready = False
            elif self.config.mode != "disagg":
                w.ready = True
            else:
                others = [(o.name, o.pid) for o in self.workers.values()
                          if o.role != w.role and o.alive and o.registered]
                w.ready = all(other in w.peers for other in others)

    async def _reconcile(self) -> None:
        """Disaggregated: keeps every live decode worker a kvmove peer of every live prefill
        worker, whatever restarted meanwhile (a connect that fails is tried again)."""
        while True:
            for decode in [w for w in self.workers.values() if w.role == "decode"]:
                for prefill in [w for w in self.workers.values() if w.role == "prefill"]:
                    if not (decode.alive and decode.registered and prefill.alive and
                            prefill.registered) or (prefill.name, prefill.pid) in decode.peers:
                        continue
                    try:
                        await self._connect(decode, prefill)
                    except (asyncio.TimeoutError, KVMoveError, zmq.ZMQError):
                        continue  # one of them died meanwhile: the next round sees it
            self._mark_ready()
            await asyncio.sleep(RECONCILE_SECONDS)

    async def _connect(self, decode: WorkerInfo, prefill: WorkerInfo) -> None:
        """Makes the two workers kvmove peers of each other: the decode worker exchanges
        metadata with the prefill worker's agent (a restarted one replaces its old self)."""
        decode_pid, prefill_pid = decode.pid, prefill.pid
        assert prefill.agent is not None
        future = self._expect(decode.name, "connect")
        self._send(decode, Connect(host=prefill.agent[0], port=prefill.agent[1]))
        if await asyncio.wait_for(future, CONNECT_SECONDS) is None:
            raise KVMoveError(f"{decode.name} could not connect to {prefill.name}")
        if decode.pid == decode_pid and prefill.pid == prefill_pid:  # both still the same
            decode.peers.add((prefill.name, prefill_pid))
            prefill.peers.add((decode.name, decode_pid))

    async def stop(self) -> None:
        """Asks every worker to exit, then terminates, then kills what is left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for worker in self.workers.values():
            if worker.alive:
                try:
                    self._send(worker, Shutdown())
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 10.0
        for worker in self.workers.values():
            if worker.process is not None:
                await end_process(worker.process, deadline)
        for task in [*self._tasks, *self._loops.values()]:
            task.cancel()
        for handle in list(self.handles.values()):
            self._end(handle, "abort", "", "the server is shutting down")
        self.control.close()
        self.context.term()
        self.launcher.close()

    # --- requests -------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams) -> Handle:
        handle = Handle(f"req-{next(self._ids)}", prompt, params)
        self.handles[handle.rid] = handle
        self._spawn(self._place(handle))
        return handle

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _place(self, handle: Handle) -> None:
        try:
            for role in self.config.pools():
                await self._wait_for_pool(handle, role)
            if handle.done:
                return
            if self.config.mode == "disagg":
                await self._place_disaggregated(handle)
            else:
                worker, decision = self._route(handle, "colocated")
                self.routing.record(handle, decision)
                self._assign(handle, worker)
                self._send(worker, Add(rid=handle.rid, prompt=handle.prompt,
                                       params=handle.params))
        except Exception as error:  # no worker left, or the control plane failed
            self._end(handle, "abort", "", f"{type(error).__name__}: {error}")
        finally:
            self.routing.release(handle)

    async def _place_disaggregated(self, handle: Handle) -> None:
        waiting = False
        try:
            while True:
                prefill, decision = self._route(handle, "prefill")
                decode = max(self._alive("decode"),
                             key=lambda w: (w.stat("free_blocks"), -w.load))
                future = self._expect(decode.name, handle.rid)
                self._send(decode, Reserve(rid=handle.rid, prompt=handle.prompt,
                                           params=handle.params, peer=prefill.name))
                lease = await asyncio.wait_for(future, self.config.request_timeout)
                if handle.done:
                    if lease:
                        self._send(decode, Abort(rid=handle.rid))
                    return
                if lease:
                    break
                if not waiting:
                    waiting = True
                    self._waiting_for_blocks += 1
                await asyncio.sleep(RESERVE_RETRY_SECONDS)
        finally:
            if waiting:
                self._waiting_for_blocks -= 1
        self._assign(handle, decode)
        if not prefill.alive:  # it died while the blocks were reserved
            self.abort(handle, f"worker {prefill.name} died")
            return
        self.routing.record(handle, decision)
        self._assign(handle, prefill)
        self._send(prefill, Add(rid=handle.rid, prompt=handle.prompt, params=handle.params,
                                decode_peer=decode.name, remote_blocks=lease.blocks,
                                epoch=lease.epoch))

    async def _wait_for_pool(self, handle: Handle, role: str) -> None:
        """Returns once a worker of ``role`` takes requests. While every one of them is being
        started again (``restart``), the request waits for it, within its deadline; with none
        coming back it fails at once (``_alive`` raises)."""
        deadline = handle.arrival + self.config.request_timeout
        while not handle.done and not any(
                w.ready for w in self.workers.values() if w.role == role):
            if not any(w.alive for w in self.workers.values() if w.role == role):
                return  # nobody is coming back: placement fails, naming the pool
            if time.monotonic() > deadline:
                raise KVMoveError(f"no {role} worker took requests within "
                                  f"{self.config.request_timeout:g} s (being restarted)")
            await asyncio.sleep(RESERVE_RETRY_SECONDS)

    def _alive(self, role: str) -> list[WorkerInfo]:
        workers = [w for w in self.workers.values() if w.role == role and w.alive and w.ready]
        if not workers:
            raise KVMoveError(f"no {role} worker is alive")
        return workers

    def _route(self, handle: Handle, role: str) -> tuple[WorkerInfo, Decision]:
        return self.routing.pick(handle, self._alive(role), self.handles)

    def _assign(self, handle: Handle, worker: WorkerInfo) -> None:
        handle.workers.append(worker.name)
        worker.requests.add(handle.rid)

    def _expect(self, worker: str, key: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._futures[worker, key] = future
        return future

    def _send(self, worker: WorkerInfo, message: Any) -> None:
        """Sends now or raises (ZMQError: a worker that is gone is unreachable)."""
        sent = self.socket.send_multipart([worker.identity, encode(message)],
                                          flags=zmq.NOBLOCK)
        if sent.done() and sent.exception() is not None:
            raise sent.exception()

    def abort(self, handle: Handle, reason: str, skip: str | None = None) -> None:
        """Ends a request for its client, and has its workers (but ``skip``, which ended it
        itself) drop it: its batch slot and blocks go back, a KV hand-off in flight is aborted
        (the prefill's stream) or cancelled (the decode's lease)."""
        workers = [name for name in handle.workers if name != skip]
        self._end(handle, "abort", "", reason)
        for name in workers:
            worker = self.workers[name]
            if worker.alive:
                try:
                    self._send(worker, Abort(rid=handle.rid))
                except zmq.ZMQError:
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
            self.workers[name].requests.discard(handle.rid)
        self.metrics.requests.labels(outcome="error" if reason == "abort" else reason).inc()
        handle.events.put_nowait(("end", reason, text, error))

    # --- events from workers --------------------------------------------------------------

    async def _receive(self) -> None:
        """Every event from the workers, until the router stops. Nothing a peer sends ends
        this loop: a message from an identity that is no live worker process's, or one that
        does not parse, is logged and dropped (``kvmove_control_messages_dropped_total``); an
        error handling a valid one is logged. Should it end anyway, ``/health`` says so."""
        while True:
            frames = await self.socket.recv_multipart()
            try:
                self._dispatch(frames)
            except Exception:  # noqa: BLE001 - one event's bug must not stop every stream
                logger.exception("handling a control event failed")
                self._drop("error", "see the exception above")

    def _dispatch(self, frames: list[bytes]) -> None:
        worker = self._identities.get(frames[0])
        if worker is None or not worker.alive:
            self._drop("unknown_peer", f"from {frames[0][:80]!r}, no live worker's identity")
            return
        if len(frames) != 2:
            self._drop("malformed", f"{len(frames) - 1} frames from {worker.name}, want 1")
            return
        try:
            event = parse_event(frames[1])
        except PeerError as error:
            self._drop("malformed", f"from {worker.name}: {error}")
            return
        self._on_event(worker, event)

    def _drop(self, reason: str, detail: str) -> None:
        self.metrics.control_dropped.labels(reason=reason).inc()
        self._drops[reason] = count = self._drops.get(reason, 0) + 1
        level = logging.WARNING if count <= LOUD_DROPS else logging.DEBUG
        logger.log(level, "control message dropped (%s, %d so far): %s", reason, count, detail)

    def _on_event(self, worker: WorkerInfo, event: Event) -> None:
        match event:
            case Ready():
                self.routing.forget(worker)  # a new process: its cache starts empty
                worker.agent, worker.registered = event.agent, True
                self._mark_ready()
            case Stats():
                worker.stats = event
                self._update_gauges()
            case Connected():
                self._resolve(worker.name, "connect", event.peer)
            case Reserved():
                self._resolve(worker.name, event.rid, event if event.blocks else None)
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
        holds = rid in worker.requests or (worker.name, rid) in self._futures
        self._resolve(worker.name, rid, None)  # a failed reserve
        handle = self.handles.get(rid)
        worker.requests.discard(rid)
        if event.reason == "handed_off":
            self._record_handoff(event, handle)
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

    def _record_handoff(self, event: Ended, handle: Handle | None) -> None:
        """A prefill worker's KV hand-off ended (its ack may come after the response)."""
        self.metrics.kv_bytes.inc(event.kv_bytes)
        self.metrics.observe_handoff(event.timeline, None)
        if event.kv_seconds is None or event.kv_exposed_seconds is None:
            return
        self.metrics.kv_seconds.observe(event.kv_seconds)
        self.metrics.kv_exposed.observe(event.kv_exposed_seconds)

    def _resolve(self, worker: str, key: str, value: Any) -> None:
        future = self._futures.pop((worker, key), None)
        if future is not None and not future.done():
            future.set_result(value)

    def _update_gauges(self) -> None:
        m = self.metrics
        for pool in self.config.pools():
            members = [w for w in self.workers.values() if w.role == pool and w.alive]
            queue = sum(w.stat("waiting") + w.stat("loading") for w in members)
            if pool == "decode":
                queue += self._waiting_for_blocks
            m.queue.labels(pool=pool).set(queue)
            m.running.labels(pool=pool).set(sum(w.stat("running") for w in members))
            m.workers.labels(pool=pool).set(sum(not w.draining for w in members))
        for w in self.workers.values():
            if w.stats is not None:
                m.free_blocks.labels(worker=w.name).set(w.stats.free_blocks)

    async def _monitor(self) -> None:
        """A dead worker process: ``/health`` shows it, its requests end with an error (and
        their other workers are told), and it is started again (``restart``)."""
        while True:
            for worker in self.workers.values():
                self.metrics.alive.labels(worker=worker.name).set(int(worker.alive))
                if worker.alive and worker.process.poll() is not None:
                    self._on_death(worker)
            await asyncio.sleep(MONITOR_SECONDS)

    def _on_death(self, worker: WorkerInfo) -> None:
        worker.alive = False
        self._identities.pop(worker.identity, None)  # what it sent last is not heard
        self.routing.forget(worker)
        code = worker.process.returncode
        logger.log(logging.INFO if self._stopped or worker.draining else logging.WARNING,
                   "worker %s (pid %s) exited with code %s", worker.name, worker.pid, code)
        for rid in list(worker.requests):
            handle = self.handles.get(rid)
            if handle is not None:
                self.abort(handle, f"worker {worker.name} died (exit code {code})",
                           skip=worker.name)
        worker.requests.clear()
        for (name, key), future in list(self._futures.items()):
            if name == worker.name and not future.done():
                future.set_exception(KVMoveError(f"worker {name} died"))
        for other in self.workers.values():
            other.peers = {p for p in other.peers if p[0] != worker.name}
        self._mark_ready()
        if worker.draining:  # the planner ended it (or it died draining): not started again
            self._retire(worker)
        elif self.config.restart and not self._stopped:
            self.metrics.restarts.labels(worker=worker.name).inc()
            worker.restarts += 1
            self._launch(worker)

    # --- the planner's pools (planner.py decides) ------------------------------------------

    def pool_sample(self, pool: str) -> PoolSample:
        """``pool`` now, from its workers' last stats: those taking requests (or starting),
        what waits on them (decode: for a batch slot or blocks) and runs."""
        members = [w for w in self.workers.values()
                   if w.role == pool and w.alive and not w.draining]
        waiting = sum(w.stat("waiting") for w in members)
        utilisation = 0.0
        if pool == "decode":
            waiting += self._waiting_for_blocks
            c = self.config
            used = [max(1 - w.stat("free_blocks") / c.num_blocks, w.stat("running") /
                        c.max_num_seqs) for w in members if w.stats is not None]
            utilisation = sum(used) / len(used) if used else 0.0
        return PoolSample(len(members), waiting, sum(w.stat("running") for w in members),
                          utilisation, self.config.max_num_seqs)

    def add_worker(self, pool: str) -> WorkerInfo:
        """Starts one more worker of ``pool`` (the router's own launch path); it takes
        requests once ready (disaggregated: once a peer of the other pool)."""
        index = next(i for i in itertools.count() if f"{pool}-{i}" not in self.workers)
        name = f"{pool}-{index}"
        command = worker_command(self.config, name, pool, [], self.control.address)
        worker = self.workers[name] = WorkerInfo(name, pool, command, self.launcher)
        self._launch(worker)
        return worker

    def drain(self, pool: str) -> WorkerInfo | None:
        """Takes the least-loaded worker of ``pool`` out: no request is placed on it from
        now, those it holds finish (none is dropped), then it is shut down and not started
        again. None when the pool has no worker to spare."""
        members = [w for w in self.workers.values()
                   if w.role == pool and w.alive and not w.draining]
        if len(members) < 2:
            return None
        worker = min(members, key=lambda w: (w.load, w.stat("waiting")))
        worker.draining = True
        self._mark_ready()
        logger.info("draining %s: %d requests in flight", worker.name, worker.load)
        self._spawn(self._finish_drain(worker))
        return worker

    async def _finish_drain(self, worker: WorkerInfo) -> None:
        """Waits for its requests (and reservations) to end, then shuts it down. A request is
        never cut short for this: past ``request_timeout`` it says so, and waits on."""
        warn_at = time.monotonic() + self.config.request_timeout
        while worker.alive and (worker.requests or any(
                name == worker.name for name, _ in self._futures)):
            if time.monotonic() > warn_at:
                logger.warning("%s still drains %d requests", worker.name, worker.load)
                warn_at += self.config.request_timeout
            await asyncio.sleep(RESERVE_RETRY_SECONDS)
        if worker.alive:
            logger.info("%s drained: shutting it down", worker.name)
            try:
                self._send(worker, Shutdown())
            except zmq.ZMQError:
                pass
            await end_process(worker.process, time.monotonic() + 10.0)

    def _retire(self, worker: WorkerInfo) -> None:
        worker.retired = True
        logger.info("worker %s (pid %s) retired", worker.name, worker.pid)

    def health(self) -> dict[str, Any]:
        current = [w for w in self.workers.values() if not w.retired]
        workers = [{"name": w.name, "role": w.role, "alive": w.alive, "ready": w.ready,
                    "draining": w.draining, "pid": w.pid, "node": w.node,
                    **(w.stats.model_dump(exclude={"ev"}) if w.stats else {})}
                   for w in current]
        serving = all(any(w.alive and w.role == role for w in current)
                      for role in {w.role for w in current})
        everyone = all(w.alive for w in current)
        status = "ok" if everyone else ("degraded" if serving else "down")
        report: dict[str, Any] = {"status": status, "mode": self.config.mode,
                                  "workers": workers}
        ended = self._ended_loops()
        if ended:  # a router that no longer hears its workers serves nobody
            report.update(status="down", error=f"the router's {ended} ended")
        return report

    def _ended_loops(self) -> str:
        """The router's loops that ended (each runs until the router stops), and why."""
        if self._stopped:
            return ""
        ended = [f"{name} loop ({_why(task)})" for name, task in self._loops.items()
                 if task.done()]
        return ", ".join(ended)


def _why(task: asyncio.Task) -> str:
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    return f"{type(error).__name__}: {error}" if error is not None else "returned"

