"""Prefill/decode disaggregation in vLLM over kvmove: the worker side (see ``pd_scheduler.py``).

One ``kvmove.Agent`` per worker wraps vLLM's own KV tensors (``KVCache.wrap``: no copy, each
tensor registered once). The prefill's agent listens on ``kv_port`` (+ its tensor-parallel
rank); a decode's agent connects to it the first time it loads from it.

The two workers talk in notifications (JSON, between agents that share the deployment key):

- decode -> prefill ``{"op": "want", "key", "blocks", "epoch"}``: "stream request ``key``'s
  KV into my ``blocks`` under lease ``epoch``" (``blocks`` empty: "I need nothing, let your
  blocks go").
- prefill -> decode ``{"op": "refuse", "key", "reason"}``: the prefill no longer holds it
  (lease over, aborted, never had it): the decode cancels its lease and reports the blocks as
  load errors, so vLLM recomputes them.

A "want" that arrives before the prefill knows the request (push mode: both instances got the
request at once) waits as a reservation until the prefill's forward pass reaches it.

Threads: vLLM's model thread calls ``start_load_kv``/``save_kv_layer``/``wait_for_save``/
``get_finished``; one thread of ours reads notifications and ends leases; a small pool runs
the decode's loads and waits for the prefill's sends. One lock guards the state; nothing
blocking runs under it.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

import kvmove
from kvmove.auth import key_from_file
from kvmove.errors import ChecksumError, KVMoveError
from kvmove.integrations.vllm.config import ConnectorConfig, KVRole, layout_of, wrap_kv_caches
from kvmove.integrations.vllm.pd_scheduler import PDMetadata as Metadata
from kvmove.integrations.vllm.pd_specs import LoadSpec, PushSpec, SendSpec
from kvmove.runtime import unpin, unpinned

logger = init_logger("vllm.kvmove.pd_worker")

MAX_MESSAGE = 1 << 16          # bytes of one notification
MAX_RESERVATIONS = 4096        # "want"s waiting for a request the prefill has not seen yet
REMEMBER_DONE = 65536          # keys of ended sends, so a late "want" is refused at once
POLL_SECONDS = 0.05
# vLLM steps without pause while a request waits for its KV (or holds it for a decode), one
# empty step after the other: an idle step's get_finished waits this long for a transfer to
# end (it returns at once when one does), so the wait does not spin a core.
IDLE_WAIT_SECONDS = 0.02
MESSAGE_SECONDS = 5.0


@dataclass
class _Outgoing:
    """Prefill side: one request's KV, from its forward pass until its blocks go back."""

    req_id: str
    key: str                       # what the decode asks for: transfer id or request id
    blocks: list[int]
    layers: set[int] = field(default_factory=set)  # saved by the forward pass so far
    posted: set[int] = field(default_factory=set)  # streamed to the decode
    overlapped: int = 0            # layers posted before the forward pass ended
    complete: bool = False         # every layer is in the blocks
    stream: Any = None             # kvmove.SaveStream once the decode asked
    sent: bool = False             # the stream ended (or there was nothing to send)
    held: bool = False             # vLLM handed us its blocks (request_finished)
    deadline: float = float("inf")
    abort: bool = False


@dataclass
class _Reservation:
    peer: str
    blocks: list[int]
    epoch: int
    since: float


class PDWorker:
    """The worker side of ``KVMoveConnector`` for ``kv_producer``/``kv_consumer``."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, kv_cache_config: Any) -> None:
        self.config = config
        self.layout = layout_of(vllm_config)
        self.agent: kvmove.Agent | None = None
        self.layer_index: dict[str, int] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a transfer ended
        self._idle = False
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvmove-vllm", initializer=unpin)
        self._thread: threading.Thread | None = None
        # prefill side
        self._out: dict[str, _Outgoing] = {}            # by key
        self._out_by_req: dict[str, _Outgoing] = {}
        self._step: list[_Outgoing] = []                 # pushes in this forward pass
        self._step_meta: Metadata | None = None          # whose pushes _step holds
        self._reservations: dict[str, _Reservation] = {}
        self._done_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sent: set[str] = set()
        # decode side
        self._peers: dict[tuple[str, int], str] = {}
        self._connect_lock = threading.Lock()
        self._loads: dict[str, Any] = {}                 # key -> LoadStream
        self._loading = 0                                # loads submitted, not yet ended
        self._received: set[str] = set()
        self._load_errors: set[int] = set()
        self.bytes_loaded = 0

    # ---- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        cache = wrap_kv_caches(kv_caches, self.layout)
        cfg = self.config
        key = key_from_file(cfg.key_file).secret if cfg.key_file else None
        role = "prefill" if cfg.role is KVRole.PRODUCER else "decode"
        with unpinned():   # the agent's threads, its listener's and ours
            self.agent = kvmove.Agent(f"vllm-{role}-{cfg.engine_id}-{cfg.tp_rank}", cache,
                                      transports=cfg.transports, checksums=cfg.checksums,
                                      key=key, host=cfg.host)
            if cfg.role is KVRole.PRODUCER:
                self.agent.listen(cfg.host, cfg.port + cfg.tp_rank)
            self._thread = threading.Thread(target=self._serve, name="kvmove-vllm-notify",
                                            daemon=True)
            self._thread.start()
        logger.info("kvmove: %s agent %s over %d layers of %s (%s)%s", role, self.agent.name,
                    len(kv_caches), self.layout, cache.device,
                    f", listening on {cfg.host}:{cfg.port + cfg.tp_rank}"
                    if cfg.role is KVRole.PRODUCER else "")

    def shutdown(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.agent is not None:
            self.agent.close()

    # ---- vLLM's model thread ----------------------------------------------------------------

    def start_load_kv(self, meta: Metadata) -> None:
        # vLLM 0.32 calls this after the forward pass when no load is synchronous: the pushes
        # of this step began at its first save_kv_layer already (_begin_step is idempotent).
        with self._lock:
            self._loading += len(meta.loads)
        for spec in meta.loads:
            self._pool.submit(self._load, spec)
        with self._lock:
            self._idle = bool(getattr(meta, "idle", False)) and not meta.loads
            self._begin_step(meta)
            for send in meta.sends:
                self._hold(send)

    def _begin_step(self, meta: Metadata) -> None:
        if meta is not self._step_meta:
            self._step_meta = meta
            self._step = [self._begin_push(p) for p in meta.pushes]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before vLLM schedules the request (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: Metadata) -> None:
        """Layer ``layer_name``'s KV is in vLLM's blocks: post it to every decode already
        waiting for a request of this forward pass (the others get it once they ask)."""
        if not meta.pushes:
            return
        layer = self.layer_index[layer_name]
        with self._lock:
            self._begin_step(meta)
            for out in self._step:
                out.layers.add(layer)
                self._post_ready(out)

    def wait_for_save(self) -> None:
        """The forward pass is over: every layer of its pushes is in the blocks (also those
        no ``save_kv_layer`` reported: an attention backend that does not call it)."""
        with self._lock:
            for out in self._step:
                out.overlapped = len(out.posted)
                out.layers.update(range(len(self.layer_index)))
                out.complete = True
                self._post_ready(out)
            self._step = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        with self._lock:
            if self._idle and not (self._sent or self._received) and \
                    (self._loading or self._out):
                self._changed.wait(IDLE_WAIT_SECONDS)
            self._release_expired(time.monotonic())
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> None:
        return None   # the scheduler side needs no report from P/D workers

    # ---- prefill side -----------------------------------------------------------------------

    def _begin_push(self, push: PushSpec) -> _Outgoing:
        out = _Outgoing(push.req_id, push.transfer_id, list(push.blocks))
        self._out[out.key] = out
        self._out_by_req[out.req_id] = out
        self._take_reservation(out)
        return out

    def _hold(self, send: SendSpec) -> None:
        logger.debug("kvmove: holding %s (%d blocks)%s", send.req_id, len(send.blocks),
                     " to abort" if send.abort else "")
        out = self._out_by_req.get(send.req_id)
        if out is None:
            out = _Outgoing(send.req_id, send.transfer_id or send.req_id, list(send.blocks))
            self._out[out.key] = out
            self._out_by_req[out.req_id] = out
        out.blocks = list(send.blocks)
        out.complete = out.held = True
        out.deadline = send.deadline
        if send.abort:
            out.abort = True
            if out.stream is not None and not out.sent:
                out.stream.abort(wait=False)
                self._pool.submit(self._await_send, out)
            elif out.stream is None:
                out.sent = True
        else:
            self._take_reservation(out)
        self._release_if_done(out)

    def _take_reservation(self, out: _Outgoing) -> None:
        want = self._reservations.pop(out.key, None)
        if want is not None:
            self._start_send(out, want)

    def _start_send(self, out: _Outgoing, want: _Reservation) -> None:
        """Streams ``out`` into the decode's lease: every layer computed so far at once, the
        rest as ``save_kv_layer`` saves them."""
        if out.stream is not None or out.sent or out.abort:
            self._refuse(want.peer, out.key, "already sent or aborted")
            return
        if not want.blocks:      # the decode needs nothing (a local prefix hit)
            out.sent = True
            self._release_if_done(out)
            return
        if len(want.blocks) > len(out.blocks):
            self._refuse(want.peer, out.key, f"asked for {len(want.blocks)} blocks, the "
                         f"prefill holds {len(out.blocks)}")
            out.sent = True
            self._release_if_done(out)
            return
        assert self.agent is not None
        logger.debug("kvmove: streaming %s to %s (%s, layers so far %s)", out.key, want.peer,
                     "complete" if out.complete else "in the forward pass", sorted(out.layers))
        if out.complete:
            out.layers.update(range(len(self.layer_index)))
        src = out.blocks[len(out.blocks) - len(want.blocks):]
        try:
            out.stream = self.agent.stream_to(want.peer, src, want.blocks, out.key,
                                              epoch=want.epoch)
        except KVMoveError as error:
            logger.warning("kvmove: cannot stream %s to %s: %s", out.key, want.peer, error)
            out.sent = True
            self._release_if_done(out)
            return
        self._post_ready(out)

    def _post_ready(self, out: _Outgoing) -> None:
        """Streams the layers in the blocks not streamed yet; finishes once all are."""
        if out.stream is None or out.sent:
            return
        for layer in sorted(out.layers - out.posted):
            self._guard(out, out.stream.save_layer, layer)
            out.posted.add(layer)
        if out.complete and len(out.posted) == len(self.layer_index):
            self._guard(out, out.stream.finish)
            self._pool.submit(self._await_send, out)

    def _guard(self, out: _Outgoing, call: Any, *args: Any) -> None:
        """A stream call; a stream that failed already (its decode died or gave up) is left
        for ``_await_send`` to end."""
        try:
            call(*args)
        except KVMoveError as error:
            logger.debug("kvmove: stream %s: %s", out.key, error)

    def _await_send(self, out: _Outgoing) -> None:
        started = time.monotonic()
        try:
            out.stream.wait_for_save(timeout=self.config.load_timeout)
            logger.info("kvmove: sent %s (%d blocks, %d of %d layers during the forward "
                        "pass), acknowledged %.1f ms after the last", out.key, len(out.blocks),
                        out.overlapped, len(self.layer_index),
                        1e3 * (time.monotonic() - started))
        except KVMoveError as error:
            logger.warning("kvmove: sending %s to %s failed: %s", out.key, out.stream.peer,
                           error)
            try:
                out.stream.abort(timeout=self.config.load_timeout)
            except KVMoveError:
                pass
        with self._lock:
            out.sent = True
            self._release_if_done(out)

    def _release_if_done(self, out: _Outgoing) -> None:
        """vLLM gets the blocks back once it handed them to us and no stream reads them."""
        if not (out.held and out.sent):
            return
        self._sent.add(out.req_id)
        self._changed.notify_all()
        self._out.pop(out.key, None)
        self._out_by_req.pop(out.req_id, None)
        self._done_keys[out.key] = None
        while len(self._done_keys) > REMEMBER_DONE:
            self._done_keys.popitem(last=False)

    def _release_expired(self, now: float) -> None:
        for out in list(self._out.values()):
            if out.held and out.stream is None and not out.sent and now > out.deadline:
                logger.info("kvmove: lease of %s ended before a decode asked for it; "
                            "its %d blocks go back to vLLM", out.key, len(out.blocks))
                out.sent = True
                self._release_if_done(out)
        horizon = now - self.config.lease_seconds
        for key, want in list(self._reservations.items()):
            if want.since < horizon:
                del self._reservations[key]

    def _on_want(self, peer: str, message: dict[str, Any]) -> None:
        key, blocks, epoch = message.get("key"), message.get("blocks"), message.get("epoch")
        if not isinstance(key, str) or not isinstance(blocks, list) or \
                not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks) or \
                not isinstance(epoch, int) or isinstance(epoch, bool):
            logger.warning("kvmove: malformed want from %s: %.200r", peer, message)
            return
        want = _Reservation(peer, blocks, epoch, time.monotonic())
        logger.debug("kvmove: %s wants %s into %d blocks", peer, key, len(blocks))
        with self._lock:
            out = self._out.get(key)
            if out is not None:
                self._start_send(out, want)
            elif key in self._done_keys:
                self._refuse(peer, key, "its lease ended or it was sent already")
            elif len(self._reservations) >= MAX_RESERVATIONS:
                self._refuse(peer, key, f"{MAX_RESERVATIONS} reservations are waiting")
            else:
                self._reservations[key] = want

    def _refuse(self, peer: str, key: str, reason: str) -> None:
        self._pool.submit(self._send, peer, {"op": "refuse", "key": key, "reason": reason})

    # ---- decode side ------------------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> None:
        """Leases ``spec.blocks``, asks the prefill to stream into them and waits; on any
        failure the blocks are reported as load errors (vLLM recomputes them), but only once
        no byte of the prefill's can land in them any more."""
        assert self.agent is not None
        started = time.monotonic()
        load = None
        try:
            peer = self._peer(spec.remote_host, spec.remote_port)
            logger.debug("kvmove: load %s: peer %s after %.1f ms", spec.req_id, peer,
                         1e3 * (time.monotonic() - started))
            if spec.blocks:
                load = self.agent.expect(peer, spec.key, spec.blocks,
                                         timeout=self.config.load_timeout).start_load()
                with self._lock:
                    self._loads[spec.key] = load
            self._send(peer, {"op": "want", "key": spec.key, "blocks": spec.blocks,
                              "epoch": load.epoch if load is not None else 0}, check=True)
            if load is not None:
                load.wait_all(timeout=self.config.load_timeout + 1.0)
                nbytes = len(spec.blocks) * self.agent.cache.block_nbytes
                self.bytes_loaded += nbytes
                logger.info("kvmove: loaded %s (%s): %d tokens, %d blocks, %d bytes in "
                            "%.1f ms", spec.req_id, spec.mode.value, spec.num_tokens,
                            len(spec.blocks), nbytes, 1e3 * (time.monotonic() - started))
            errors: list[int] = []
        except ChecksumError as error:
            errors = load.bad_blocks() if load is not None else list(spec.blocks)
            logger.warning("kvmove: load of %s: %s", spec.req_id, error)
        except Exception as error:  # noqa: BLE001 - any failure: recompute, never hang
            errors = list(spec.blocks)
            with self._connect_lock:   # connect afresh next time: it may have restarted
                self._peers.pop((spec.remote_host, spec.remote_port), None)
            logger.warning("kvmove: load of %s from %s:%d failed after %.1f s: %s",
                           spec.req_id, spec.remote_host, spec.remote_port,
                           time.monotonic() - started, error)
        if load is not None and errors:
            load.cancel()
            if not load.wait_released(self.config.load_timeout):
                logger.error("kvmove: lease of %s not released; its blocks stay failed",
                             spec.req_id)
        with self._lock:
            self._loads.pop(spec.key, None)
            self._loading -= 1
            if spec.blocks:
                self._received.add(spec.req_id)
                self._changed.notify_all()
            self._load_errors.update(errors)

    def _peer(self, host: str, port: int) -> str:
        with self._connect_lock:
            name = self._peers.get((host, port))
            assert self.agent is not None
            if name is None or name not in self.agent.peers:
                name = self.agent.connect(host, port, timeout=self.config.load_timeout)
                self._peers[(host, port)] = name
            return name

    def _on_refuse(self, peer: str, message: dict[str, Any]) -> None:
        with self._lock:
            load = self._loads.get(str(message.get("key")))
        if load is not None and load.peer == peer:
            logger.warning("kvmove: %s refused %s: %.200s", peer, message.get("key"),
                           message.get("reason"))
            load.cancel()

    # ---- notifications ----------------------------------------------------------------------

    def _send(self, peer: str, message: dict[str, Any], check: bool = False) -> None:
        """A message to ``peer``; ``check``: a decode's "want", which may take the load's
        whole deadline on a loaded host (its failure fails the load)."""
        assert self.agent is not None
        seconds = self.config.load_timeout if check else MESSAGE_SECONDS
        try:
            self.agent.write(peer, [], [], notify=json.dumps(message).encode()).wait(seconds)
        except KVMoveError as error:
            if check:
                raise
            logger.warning("kvmove: message to %s lost: %s", peer, error)

    def _serve(self) -> None:
        assert self.agent is not None
        while not self._closed.is_set():
            try:
                peer, data = self.agent.wait_notification(POLL_SECONDS)
            except kvmove.errors.TimeoutError:
                continue
            except KVMoveError:
                return   # the agent closed
            try:
                message = json.loads(data[:MAX_MESSAGE])
                op = message.get("op") if isinstance(message, dict) else None
            except ValueError:
                op = None
            if op == "want":
                self._on_want(peer, message)
            elif op == "refuse":
                self._on_refuse(peer, message)
            else:
                logger.warning("kvmove: unknown message from %s: %.200r", peer, data)
