"""The router: worker processes, the ZeroMQ control plane, request placement, metrics.

It binds one ROUTER socket; every worker process (``worker_main``) connects a DEALER socket
named after itself. Placement:

* ``colocated`` / ``chunked``: the worker with the fewest queued + running requests.
* ``disagg``: the prefill worker with the fewest requests is picked; the decode worker with
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
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvmove.errors import ConfigError, KVMoveError
from kvmove.serve.metrics import Metrics

__all__ = ["MODES", "Handle", "Router", "ServeConfig", "WorkerInfo"]

MODES = ("colocated", "chunked", "disagg")
MONITOR_SECONDS = 0.1
RESERVE_RETRY_SECONDS = 0.02
RECONCILE_SECONDS = 0.1
CONNECT_SECONDS = 10.0


@dataclass(frozen=True)
class ServeConfig:
    """What ``kvmove-serve`` runs: the mode, how many workers of each kind, the engine."""

    mode: str = "disagg"
    workers: int = 2        # colocated / chunked: engine instances
    prefill: int = 1        # disagg
    decode: int = 1         # disagg
    model: str = "tiny"
    chunk_size: int = 512   # chunked (and the prefill workers of disagg)
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    host: str = "127.0.0.1"          # the HTTP server
    port: int = 8000
    control_host: str = "127.0.0.1"  # the ZeroMQ control plane
    agent_host: str = "127.0.0.1"    # where workers' kvmove agents listen
    transports: str | None = None
    request_timeout: float = 120.0
    transfer_timeout: float = 60.0  # a KV hand-off's lease (disagg), before it is given up
    start_timeout: float = 120.0
    pin_cpus: bool = True   # each worker on its own cores when there are enough
    store_dir: str | None = None  # a KVStore disk tier per prefill/colocated worker, in here
    store_host_gb: float = 0.0    # and a host tier of this size (0: none)
    store_disk_gb: float = 16.0   # the disk tier's size per worker
    checksums: bool = True        # per-block checksums on every KV hand-off (disagg)
    restart: bool = True          # a dead worker is started again and re-admitted

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("workers", "prefill", "decode", "chunk_size", "num_blocks", "block_size",
                     "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("request_timeout", "transfer_timeout", "start_timeout"):
            if not 0 < getattr(self, name) < 1e6:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.store_host_gb < 1e6:
            raise ConfigError(f"store_host_gb must be >= 0, got {self.store_host_gb!r}")
        if not 0 < self.store_disk_gb < 1e6:
            raise ConfigError(f"store_disk_gb must be positive, got {self.store_disk_gb!r}")

    def store_args(self, name: str, role: str) -> list[str]:
        """A worker's KVStore options: prefill and colocated workers only (decode workers
        never prefill), each with its own directory (a disk tier is one process's)."""
        if role == "decode" or (self.store_dir is None and not self.store_host_gb):
            return []
        args = ["--store-host-gb", str(self.store_host_gb)]
        if self.store_dir is not None:
            args += ["--store-dir", os.path.join(self.store_dir, name),
                     "--store-disk-gb", str(self.store_disk_gb)]
        return args

    def roles(self) -> list[tuple[str, str]]:
        """(worker name, role) for every worker process."""
        if self.mode == "disagg":
            return ([(f"prefill-{i}", "prefill") for i in range(self.prefill)] +
                    [(f"decode-{i}", "decode") for i in range(self.decode)])
        return [(f"worker-{i}", "colocated") for i in range(self.workers)]

    def pools(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.mode == "disagg" else ("colocated",)


@dataclass
class WorkerInfo:
    name: str
    role: str
    process: subprocess.Popen
    agent: list | None = None
    ready: bool = False
    alive: bool = True
    stats: dict[str, int] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    command: list[str] = field(default_factory=list)
    restarts: int = 0
    registered: bool = False  # its "ready" event came: its agent listens
    # (name, pid) of the other pool's workers this one is a kvmove peer of, each incarnation
    peers: set[tuple[str, int]] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def load(self) -> int:
        return len(self.requests)


class Handle:
    """One client request: its tokens arrive in ``events`` as ("token", id) and one
    ("end", reason, text, error)."""

    def __init__(self, rid: str, prompt: list[int], params: dict) -> None:
        self.rid, self.prompt, self.params = rid, prompt, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.num_tokens = 0
        self.workers: list[str] = []
        self.done = False
        self.kv_exposed: float | None = None
        self.ttft: float | None = None


class Router:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.workers: dict[str, WorkerInfo] = {}
        self.handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self._futures: dict[tuple[str, str], asyncio.Future] = {}
        self._waiting_for_blocks = 0
        self._tasks: set[asyncio.Task] = set()  # running ones only: each drops itself
        self._stopped = False
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.socket.bind_to_random_port(f"tcp://{config.control_host}")
        self.endpoint = f"tcp://{config.control_host}:{port}"

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

    def _command(self, name: str, role: str, cpus: list[int]) -> list[str]:
        c = self.config
        command = [sys.executable, "-m", "kvmove.serve.worker_main", "--name", name,
                   "--role", role, "--router", self.endpoint, "--model", c.model,
                   "--num-blocks", str(c.num_blocks), "--block-size", str(c.block_size),
                   "--chunk-size", str(c.chunk_size if c.mode != "colocated" else 0),
                   "--max-num-seqs", str(c.max_num_seqs),
                   "--max-num-batched-tokens", str(c.max_num_batched_tokens),
                   "--agent-host", c.agent_host, "--transfer-timeout", str(c.transfer_timeout)]
        if c.transports:
            command += ["--transports", c.transports]
        if c.checksums and role == "prefill":
            command += ["--checksums"]
        command += c.store_args(name, role)
        if cpus:
            command += ["--cpus", ",".join(map(str, cpus))]
        return command

    @staticmethod
    def _popen(command: list[str]) -> subprocess.Popen:
        # PYTHONSAFEPATH: run from a source checkout, `-m` would import the checkout's kvmove
        # (without its compiled core) instead of the installed one
        return subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONSAFEPATH": "1"})

    async def _start(self) -> None:
        c = self.config
        cpus = cpu_shares(len(c.roles())) if c.pin_cpus else [[] for _ in c.roles()]
        for (name, role), mine in zip(c.roles(), cpus):
            command = self._command(name, role, mine)
            self.workers[name] = WorkerInfo(name, role, self._popen(command), command=command)
        self._spawn(self._receive())
        self._spawn(self._monitor())
        deadline = time.monotonic() + c.start_timeout
        if c.mode == "disagg":
            self._spawn(self._reconcile())
        while not all(w.ready for w in self.workers.values()):
            dead = [w.name for w in self.workers.values() if not w.alive]
            if dead:
                raise KVMoveError(f"worker processes {dead} exited during start-up")
            if time.monotonic() > deadline:
                raise KVMoveError(f"workers not ready after {c.start_timeout:g} s: "
                                  f"{[w.name for w in self.workers.values() if not w.ready]}")
            await asyncio.sleep(0.05)

    def _mark_ready(self) -> None:
        """A worker takes requests once registered and, disaggregated, a kvmove peer of every
        registered worker of the other pool (each one's current incarnation)."""
        for w in self.workers.values():
            if not (w.alive and w.registered):
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
        future = self._expect(decode.name, "connect")
        self._send(decode, {"op": "connect", "host": prefill.agent[0],
                            "port": prefill.agent[1]})
        if await asyncio.wait_for(future, CONNECT_SECONDS) is None:
            raise KVMoveError(f"{decode.name} could not connect to {prefill.name}")
        if decode.pid == decode_pid and prefill.pid == prefill_pid:  # both still the same
            decode.peers.add((prefill.name, prefill_pid))
            prefill.peers.add((decode.name, decode_pid))

    def _readmit(self, worker: WorkerInfo) -> None:
        """Starts a dead worker again under its name; it takes requests once it registered
        and (disaggregated) the reconcile loop made it every survivor's peer."""
        worker.restarts += 1
        worker.ready, worker.registered, worker.agent, worker.stats = False, False, None, {}
        worker.peers.clear()
        worker.process = self._popen(worker.command)
        worker.alive = True

    async def stop(self) -> None:
        """Asks every worker to exit, then terminates, then kills what is left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for worker in self.workers.values():
            if worker.alive:
                try:
                    self._send(worker, {"op": "shutdown"})
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 10.0
        for worker in self.workers.values():
            while worker.process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if worker.process.poll() is None:
                worker.process.terminate()
                try:
                    worker.process.wait(3)
                except subprocess.TimeoutExpired:
                    worker.process.kill()
                    worker.process.wait(3)
        for task in list(self._tasks):
            task.cancel()
        for handle in list(self.handles.values()):
            self._end(handle, "abort", "", "the server is shutting down")
        self.socket.close()
        self.context.term()

    # --- requests -------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: dict) -> Handle:
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
                worker = self._least_loaded("colocated")
                self._assign(handle, worker)
                self._send(worker, {"op": "add", "rid": handle.rid, "prompt": handle.prompt,
                                    "params": handle.params})
        except Exception as error:  # no worker left, or the control plane failed
            self._end(handle, "abort", "", f"{type(error).__name__}: {error}")

    async def _place_disaggregated(self, handle: Handle) -> None:
        message = {"rid": handle.rid, "prompt": handle.prompt, "params": handle.params}
        waiting = False
        try:
            while True:
                prefill = self._least_loaded("prefill")
                decode = max(self._alive("decode"),
                             key=lambda w: (w.stats.get("free_blocks", 0), -w.load))
                future = self._expect(decode.name, handle.rid)
                self._send(decode, {"op": "reserve", **message, "peer": prefill.name})
                lease = await asyncio.wait_for(future, self.config.request_timeout)
                if handle.done:
                    if lease:
                        self._send(decode, {"op": "abort", "rid": handle.rid})
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
        self._assign(handle, prefill)
        self._send(prefill, {"op": "add", **message, "decode_peer": decode.name,
                             "remote_blocks": lease["blocks"], "epoch": lease["epoch"]})

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

    def _least_loaded(self, role: str) -> WorkerInfo:
        return min(self._alive(role), key=lambda w: (w.load, w.stats.get("waiting", 0)))

    def _assign(self, handle: Handle, worker: WorkerInfo) -> None:
        handle.workers.append(worker.name)
        worker.requests.add(handle.rid)

    def _expect(self, worker: str, key: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._futures[worker, key] = future
        return future

    def _send(self, worker: WorkerInfo, message: dict) -> None:
        """Sends now or raises (ZMQError: a worker that is gone is unreachable)."""
        sent = self.socket.send_multipart([worker.name.encode(), json.dumps(message).encode()],
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
                    self._send(worker, {"op": "abort", "rid": handle.rid})
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
        while True:
            name, payload = await self.socket.recv_multipart()
            worker = self.workers.get(name.decode())
            if worker is not None:
                self._on_event(worker, json.loads(payload))

    def _on_event(self, worker: WorkerInfo, event: dict) -> None:
        kind = event["ev"]
        if kind == "ready":
            worker.agent, worker.registered = event["agent"], True
            self._mark_ready()
        elif kind == "stats":
            worker.stats = event
            self._update_gauges()
        elif kind == "connected":
            self._resolve(worker.name, "connect", event["peer"])
        elif kind == "reserved":
            blocks = event.get("blocks")
            self._resolve(worker.name, event["rid"],
                          {"blocks": blocks, "epoch": event.get("epoch")} if blocks else None)
        elif kind == "tokens":
            now = time.monotonic()
            for rid, token in event["items"]:
                handle = self.handles.get(rid)
                if handle is None:
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
        elif kind == "ended":
            self._on_ended(worker, event)

    def _on_ended(self, worker: WorkerInfo, event: dict) -> None:
        rid = event["rid"]
        self._resolve(worker.name, rid, None)  # a failed reserve
        handle = self.handles.get(rid)
        worker.requests.discard(rid)
        if event["reason"] == "handed_off":
            self.metrics.kv_bytes.inc(event["kv_bytes"])
            if event["kv_seconds"] is not None:
                self.metrics.kv_seconds.observe(event["kv_seconds"])
                self.metrics.kv_exposed.observe(event["kv_exposed_seconds"])
                if handle is not None:
                    handle.kv_exposed = event["kv_exposed_seconds"]
            return
        if handle is None:
            return
        if handle.kv_exposed is not None and handle.ttft:
            self.metrics.kv_share.observe(handle.kv_exposed / handle.ttft)
        error = event.get("error")
        if event["reason"] == "abort":
            # The other workers of the request are told: a decode whose lease ended cancels
            # the prefill's stream, a prefill whose stream failed frees the decode's lease.
            self.abort(handle, f"{worker.name}: {error or 'request aborted'}", skip=worker.name)
            return
        self._end(handle, event["reason"], event.get("text", ""), error)

    def _resolve(self, worker: str, key: str, value: Any) -> None:
        future = self._futures.pop((worker, key), None)
        if future is not None and not future.done():
            future.set_result(value)

    def _update_gauges(self) -> None:
        m = self.metrics
        for pool in self.config.pools():
            members = [w for w in self.workers.values() if w.role == pool and w.alive]
            queue = sum(w.stats.get("waiting", 0) + w.stats.get("loading", 0) for w in members)
            if pool == "decode":
                queue += self._waiting_for_blocks
            m.queue.labels(pool=pool).set(queue)
            m.running.labels(pool=pool).set(sum(w.stats.get("running", 0) for w in members))
        for w in self.workers.values():
            if "free_blocks" in w.stats:
                m.free_blocks.labels(worker=w.name).set(w.stats["free_blocks"])
            if w.stats.get("store"):
                m.set_store(w.name, w.stats["store"])
            if w.stats.get("agent"):
                m.set_agent(w.name, w.stats["agent"])

    async def _monitor(self) -> None:
        """A dead worker process: ``/health`` shows it, its requests end with an error (and
        their other workers are told), and it is started again (``restart``)."""
        while True:
            for worker in self.workers.values():
                self.metrics.alive.labels(worker=worker.name).set(int(worker.alive))
                if worker.alive and worker.process.poll() is not None:
                    worker.alive = False
                    code = worker.process.returncode
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
                    if self.config.restart and not self._stopped:
                        self.metrics.restarts.labels(worker=worker.name).inc()
                        self._readmit(worker)
            await asyncio.sleep(MONITOR_SECONDS)

    def health(self) -> dict[str, Any]:
        workers = [{"name": w.name, "role": w.role, "alive": w.alive, "ready": w.ready,
                    "pid": w.process.pid, **{k: v for k, v in w.stats.items() if k != "ev"}}
                   for w in self.workers.values()]
        serving = all(any(w.alive and w.role == role for w in self.workers.values())
                      for role in {w.role for w in self.workers.values()})
        everyone = all(w.alive for w in self.workers.values())
        status = "ok" if everyone else ("degraded" if serving else "down")
        return {"status": status, "mode": self.config.mode, "workers": workers}


def cpu_shares(num_workers: int) -> list[list[int]]:
    """Disjoint CPU sets, one per worker, when every worker can have at least one core (an
    engine instance on a real cluster has its own GPU; here its own cores); otherwise no
    pinning (empty sets) and the OS shares the cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_workers > len(cpus):
        return [[] for _ in range(num_workers)]
    each = len(cpus) // num_workers
    return [cpus[i * each:(i + 1) * each] for i in range(num_workers)]
