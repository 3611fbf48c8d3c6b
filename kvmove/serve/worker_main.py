"""One engine instance as a process, driven by the router over ZeroMQ.

``python -m kvmove.serve.worker_main --name W --role ROLE --router ipc://DIR/control ...``,
with its control identity in ``KVMOVE_SERVE_IDENTITY`` (``control.py``).

The worker connects a DEALER socket to the router's ROUTER socket. Commands in
(``messages.py``): ``add``, ``reserve`` (and lease), ``abort``, ``connect``, ``shutdown``.
Events out: ``ready`` (with its kvmove agent's listen address), ``reserved``, ``connected``,
``tokens`` (every token sampled this step), ``ended``, ``kv`` (block hashes its prefix cache
and store gained or lost: ``kv_events.py``), ``stats`` (queue, running, free blocks,
the agent's and the KVStore's counters; also the router's heartbeat), ``error``. The KV never
goes through here: prefill and decode workers move it between their own kvmove agents.

A command that does not parse is answered with an ``error`` event and the worker goes on; a
valid command that fails for a request ends that request (``ended``, abort). It logs to
stderr in ``workers.LINE_FORMAT``, which the router relays into its own log.

The process exits when told to, when its parent (the server) is gone, or on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

import torch
import zmq

from kvmove import _log
from kvmove.auth import key_from_file, resolve_key
from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import FinishReason, Request
from kvmove.engine.role import ROLES, Role
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.tokenizer import load_tokenizer
from kvmove.engine.weights_id import weights_id
from kvmove.engine.worker import EngineWorker
from kvmove.errors import KVMoveError, PeerError
from kvmove.runtime import unpinned
from kvmove.serve.control import IDENTITY_VARIABLE, worker_socket
from kvmove.serve.kv_events import KVEventSource
from kvmove.serve.messages import (
    Abort,
    Add,
    Command,
    Connect,
    Connected,
    Ended,
    Failed,
    Forget,
    HandoffStage,
    Ready,
    Reserve,
    Reserved,
    Shutdown,
    Stats,
    Timeline,
    Tokens,
    encode,
    parse_command,
)
from kvmove.serve.peer_links import PeerLinks
from kvmove.serve.workers import LINE_FORMAT
from kvmove.store import DiskTier, HostTier, KVStore

logger = logging.getLogger("kvmove.serve.worker_main")  # not __main__: under "kvmove"

STATS_SECONDS = 0.1  # how often a worker reports its queue and free blocks
IDLE_POLL_MS = 20
# How long a worker that only waits for transfers (KV in flight, nothing to compute) waits for
# a command between looks at them: it polled with no timeout, spinning on its core, which the
# threads moving that very KV (kvmove's, unpinned) and the other workers could use. A
# transfer that ends is seen within this.
TRANSFER_POLL_MS = 1


def load_model(name: str, seed: int = 0) -> tuple[LlamaForCausalLM, str | None]:
    """A preset with random weights, or a local Hugging Face directory; and the directory."""
    if name in MODEL_PRESETS:
        return LlamaForCausalLM.random(MODEL_PRESETS[name], seed=seed), None
    return LlamaForCausalLM.from_pretrained(name), name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmove-serve-worker")
    p.add_argument("--name", required=True)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--router", required=True, help="the router's ZeroMQ endpoint")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=0, help="0: whole prompts")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--agent-host", default="127.0.0.1")
    p.add_argument("--net-devices", default=None)
    p.add_argument("--key-file", default=None, help="the deployment key (else as kvmove.auth "
                   "resolves it)")
    p.add_argument("--transports", default=None)
    p.add_argument("--error-mode", default="peer")
    p.add_argument("--transfer-timeout", type=float, default=60.0)
    p.add_argument("--checksums", action="store_true",
                   help="per-block checksums on the KV this worker streams")
    p.add_argument("--store-dir", default=None, help="KVStore disk tier directory")
    p.add_argument("--store-disk-gb", type=float, default=16.0)
    p.add_argument("--store-host-gb", type=float, default=0.0, help="KVStore host tier size")
    p.add_argument("--log-level", choices=sorted(_log.LEVELS), default="info")
    p.add_argument("--cpus", default="", help="comma-separated CPU ids to run on (its own "
                   "cores, as an instance on a real cluster has its own GPU); torch uses "
                   "that many threads")
    return p


class WorkerServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.cpus:
            cpus = {int(c) for c in args.cpus.split(",")}
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(len(cpus))
        model, path = load_model(args.model, args.seed)
        self.tokenizer = load_tokenizer(path, model.config)
        self.tokens: list[list[Any]] = []
        key = key_from_file(args.key_file) if args.key_file else resolve_key()
        # A deployment's key also keys the prefix cache's hashes (the host key does not: it
        # differs between hosts, which must agree on a prefix's hashes).
        scheduler = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            chunk_size=args.chunk_size or None,
            hash_seed=key.prefix_seed())
        # The threads that move bytes and messages (the store's here, ZeroMQ's and the kvmove
        # agent's below) run on every CPU, not only on the compute thread's (--cpus):
        # kvmove.runtime.unpinned.
        with unpinned():
            self.store = _open_store(args, model)
        self.worker = EngineWorker(
            model, role=args.role, num_blocks=args.num_blocks, block_size=args.block_size,
            scheduler=scheduler, tokenizer=self.tokenizer, name=args.name,
            agent_kwargs={"transports": args.transports, "error_mode": args.error_mode,
                          "checksums": args.checksums,
                          "key": None if key.host_only else key.secret,
                          "host": args.agent_host, "net_devices": args.net_devices},
            transfer_timeout=args.transfer_timeout,
            on_token=self._on_token,
            store=self.store)
        self.requests: dict[str, Request] = {}
        # decode workers prefill nothing: no prefix the router could send a request to
        self.kv_events = (KVEventSource(self.worker.pool, self.store)
                          if args.role != Role.DECODE else None)
        with unpinned():  # libzmq starts its I/O thread with the first socket
            self.context = zmq.Context()
            self.socket = worker_socket(self.context, args.router,
                                        os.environ[IDENTITY_VARIABLE].encode())
        self.parent = os.getppid()
        self.running = True
        self._last_stats = 0.0
        self.notifications_dropped = 0
        # Its peers kept connected (a decode worker that lost a prefill peer connects to it
        # again by itself).
        self.links = PeerLinks(self.worker.agent) if self.worker.agent is not None else None

    def send(self, event: Any) -> None:
        self.socket.send(encode(event))

    def _on_token(self, request: Request, token: int) -> None:
        """Tokens go out after each step, a request's first one at once: a decode worker
        gets it with the KV, between the layers of a forward pass (``EngineWorker.step``)."""
        self.tokens.append([request.id, token])
        if len(request.output) == 1:
            self.send(Tokens(items=[tuple(item) for item in self.tokens]))
            self.tokens = []

    def serve(self) -> None:
        agent = self.worker.agent
        with unpinned():  # its listener thread, like the agent's others
            address = agent.listen() if agent is not None else None
            if self.links is not None and self.args.role == Role.DECODE:
                self.links.start()
        self.send(Ready(name=self.args.name, role=self.args.role, agent=address,
                        num_blocks=self.worker.cache.num_blocks,
                        block_size=self.args.block_size, pid=os.getpid()))
        logger.info("ready: %s, %d blocks, agent %s", self.args.role,
                    self.worker.cache.num_blocks, address)
        while self.running:
            timeout = (0 if self.worker.scheduler.has_work else
                       TRANSFER_POLL_MS if self.worker.has_work else IDLE_POLL_MS)
            if self.socket.poll(timeout):
                while self.running and self.socket.poll(0):
                    self.receive(self.socket.recv_multipart())
            if not self.running:
                break
            if self.worker.has_work:
                self.report(self.worker.step())
                if self.kv_events is not None:
                    self.kv_events.stepped()
            if self.kv_events is not None:
                for event in self.kv_events.take():
                    self.send(event)
            now = time.monotonic()
            if now - self._last_stats >= STATS_SECONDS:
                self._last_stats = now
                self.send_stats()
                if os.getppid() != self.parent:  # the server is gone: so are we
                    break

    def send_stats(self) -> None:
        scheduler = self.worker.scheduler
        agent = self.worker.agent
        if agent is not None:  # serve sends no notifications: a peer's would pile up
            self.notifications_dropped += len(agent.notifications())
        self.send(Stats(free_blocks=self.worker.pool.num_free,
                        waiting=len(scheduler.waiting), running=len(scheduler.running),
                        loading=len(self.worker.loading), sending=len(self.worker.sending),
                        store=self.store.stats() if self.store is not None else None,
                        agent=agent.stats() if agent is not None else None,
                        faults=agent.faults_injected() if agent is not None else None,
                        notifications_dropped=self.notifications_dropped,
                        lost_peers=self.links.lost() if self.links is not None else []))

    def report(self, ended: list[Request]) -> None:
        if self.tokens:
            self.send(Tokens(items=[tuple(item) for item in self.tokens]))
            self.tokens = []
        for request in ended:
            self.requests.pop(request.id, None)
            assert request.finish_reason is not None  # step() returns finished requests
            self.send(Ended(rid=request.id, reason=request.finish_reason.value,
                            error=request.error, text=request.text,
                            num_output=len(request.output), num_cached=request.num_cached,
                            num_stored=request.num_stored, kv_bytes=request.kv_bytes,
                            kv_seconds=request.kv_seconds,
                            kv_exposed_seconds=request.kv_exposed_seconds,
                            timeline=_timeline(request, self.args.role)))

    def receive(self, frames: list[bytes]) -> None:
        """One message from the router: a command that does not parse gets an ``error``
        event (the worker goes on), one that fails for a request ends the request."""
        try:
            if len(frames) != 1:
                raise PeerError(f"a command is one frame, got {len(frames)}")
            command = parse_command(frames[0])
        except PeerError as error:
            logger.warning("refused a command: %s", error)
            self.send(Failed(op=None, error=str(error)))
            return
        logger.debug("command %s", command.op)
        try:
            self.handle(command)
        except Exception as error:  # noqa: BLE001 - the router reports it to the client
            rid = getattr(command, "rid", None)
            logger.warning("%s command failed: %s: %s", command.op, type(error).__name__,
                           error)
            text = f"{type(error).__name__}: {error}"
            if rid is None:
                self.send(Failed(op=command.op, error=text))
                return
            self.requests.pop(rid, None)
            self.send(Ended(rid=rid, reason="abort", error=text))

    def handle(self, command: Command) -> None:
        match command:
            case Add():
                self.worker.add_request(self._request(command), decode_peer=command.decode_peer)
            case Reserve():  # blocks, leased and offered to the prefill worker at once
                blocks = self.reserve(self._request(command), command.peer)
                self.send(Reserved(rid=command.rid,
                                   num_blocks=None if blocks is None else len(blocks)))
            case Abort():  # the client is gone, or another worker ended the request
                self.worker.abort(command.rid)
                self.requests.pop(command.rid, None)
            case Connect():
                self.connect(command)
            case Forget():
                if self.links is not None:
                    self.links.forget(command.peer)
            case Shutdown():
                self.running = False

    def reserve(self, request: Request, peer: str) -> list[int] | None:
        """Blocks for ``request``'s KV, leased and offered to ``peer``; None while the cache
        is full. A peer this worker no longer has (it cut off a stalled one, or the other side
        dropped it) is connected to again, once, on fresh endpoints, and the offer retried."""
        for attempt in range(2):
            blocks = self.worker.reserve(request)
            if blocks is None:
                self.requests.pop(request.id)
                return None
            try:
                self.worker.start_load(request, peer)  # frees the blocks if it fails
                return blocks
            except PeerError as error:
                logger.warning("offer to %s failed (%s): connecting to it again", peer, error)
                if attempt or self.links is None or not self.links.reconnect(peer):
                    raise
        raise AssertionError("unreachable")

    def connect(self, command: Connect) -> None:
        if self.links is None:
            raise KVMoveError(f"worker {self.args.name} ({self.args.role}) has no kvmove agent")
        try:
            peer = self.links.connect(command.host, command.port)
        except KVMoveError as error:  # the router tries again
            self.send(Connected(peer=None, error=str(error)))
        else:
            self.send(Connected(peer=peer))

    def _request(self, command: Add | Reserve) -> Request:
        request = Request(command.rid, command.prompt, command.params)
        self.requests[request.id] = request
        return request

    def close(self) -> None:
        if self.links is not None:
            self.links.stop()
        self.worker.close()
        if self.store is not None:
            self.store.close()
        self.socket.close()
        self.context.term()


def _timeline(request: Request, role: str) -> Timeline | None:
    """This side's moments of the request's KV hand-off (``HANDOFF_STAGES``) that happened,
    with the prefill's last layer (each side's report stands alone); None for a request that
    had none (colocated, failed before it; on a prefill, one whose hand-off failed: its own
    moments, such as its first step, come before the last layer)."""
    t = request.timings
    if t.last_layer is None:  # no hand-off, or the prefill's clock is not ours
        return None
    stages: dict[HandoffStage, float | None]
    if role == Role.PREFILL:
        if request.finish_reason is not FinishReason.HANDED_OFF:
            return None
        stages = {"sent": t.kv_sent, "sampled": t.kv_final}
    else:  # decode: the prefill's last layer came with the KV
        stages = {"landed": t.kv_landed, "learned": t.kv_end, "first_step": t.first_step}
    return {"last_layer": t.last_layer,
            **{stage: when for stage, when in stages.items() if when is not None}}


def _open_store(args: argparse.Namespace, model: LlamaForCausalLM) -> KVStore | None:
    """The worker's KVStore, when asked for. Its namespace is the model and seed (a disk tier
    of another model is refused); its weights are those loaded (``weights_id``): new weights
    saved under the same ``--model`` path empty the disk tier instead of being served the old
    weights' KV."""
    tiers: list[HostTier | DiskTier] = []
    if args.store_host_gb > 0:
        tiers.append(HostTier(int(args.store_host_gb * 1e9)))
    if args.store_dir:
        tiers.append(DiskTier(args.store_dir, int(args.store_disk_gb * 1e9)))
    if not tiers:
        return None
    return KVStore(model.config.kv_spec(args.block_size), tiers,
                   namespace=f"{args.model}:seed={args.seed}", weights=weights_id(model))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format=LINE_FORMAT, stream=sys.stderr)  # the router relays stderr
    _log.set_level(args.log_level)
    server = WorkerServer(args)

    def stop(*_: object) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    try:
        server.serve()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
