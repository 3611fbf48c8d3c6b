"""The prefill's part of ``PDWorker``: each request's KV held and streamed into the lease a
decode offers for it. A request's hand-off is an ``Outgoing`` (``pd_outgoing.py``: the states
of its blocks and of its send); its blocks go back to vLLM exactly when vLLM handed them over
and no stream reads them.

The hand-off's messages are the stream protocol's (kvmove's lease protocol carries them,
checked and bounded like its other messages): the decode's ``Agent.offer`` arrives here as a
``kvmove.Offer`` (``Agent.wait_offer``, read by one thread of ours), and a lease that will not
be streamed into is declined (``Agent.decline``: the decode's load fails at once and
recomputes). An offer that arrives before the prefill knows the request (push: both instances
got it at once) waits as a ``_Reservation``, at most ``MAX_RESERVATIONS`` of them and
``lease_seconds`` each, until the forward pass reaches it. A request that several decode
ranks load (a decode of higher tensor parallelism: ``tp.py``) is streamed once per rank's offer,
each offer naming its share; its blocks go back once every share is served.

Threads: vLLM's model thread (steps, layers, holds, ``take_sent``), the thread that receives
offers, and the pool threads that wait for streams to end. The ``PDWorker``'s one lock guards
everything here; nothing blocking runs under it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kvmove
from kvmove import Offer
from kvmove.agent_stats import trouble_note
from kvmove.errors import ConfigError, KVMoveError
from kvmove.integrations.vllm.pd_outgoing import Blocks, Outgoing, Send, Share
from kvmove.integrations.vllm.pd_specs import PushSpec, SendSpec
from kvmove.integrations.vllm.tally import Tally
from kvmove.integrations.vllm.tp import parse_share

if TYPE_CHECKING:
    from kvmove.integrations.vllm.pd_scheduler import PDMetadata

__all__ = ["PDPrefillWorker"]

# Under "vllm.": vLLM's handlers print it beside its own lines.
logger = logging.getLogger("vllm.kvmove.pd_prefill")

MAX_RESERVATIONS = 4096        # offers waiting for a request the prefill has not seen yet
REMEMBER_DONE = 65536          # keys of ended sends, so a late offer is declined at once
POLL_SECONDS = 0.05            # the offer thread's wait, between looks at shutdown


@dataclass
class _Reservation:
    offer: Offer
    share: int
    shares: int
    since: float


class PDPrefillWorker:
    """Holds requests' KV for their decodes and streams it into the leases they offer."""

    def __init__(self, agent: kvmove.Agent, num_layers: int, lease_seconds: float,
                 timeout: float, lock: threading.Condition, pool: ThreadPoolExecutor,
                 tally: Tally | None = None) -> None:
        self.agent = agent
        self.tally = tally or Tally()   # what vLLM's metrics show (get_kv_connector_stats)
        self.num_layers = num_layers
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        self._lock = lock          # the PDWorker's: notified when blocks go back
        self._pool = pool
        self._out: dict[str, Outgoing] = {}           # by key (the offers' request id)
        self._out_by_req: dict[str, Outgoing] = {}    # by vLLM's request id: all of them
        self._step: list[Outgoing] = []               # pushes in this forward pass
        self._step_meta: PDMetadata | None = None     # whose pushes _step holds
        self._reservations: dict[str, list[_Reservation]] = {}   # by key: its shares' offers
        self._done_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sent: set[str] = set()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread that receives the decodes' offers."""
        self._thread = threading.Thread(target=self._serve, name="kvmove-vllm-offers",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    @property
    def pending(self) -> bool:
        """Some request's blocks have not gone back yet."""
        return bool(self._out_by_req)

    @property
    def has_sent(self) -> bool:
        return bool(self._sent)

    def take_sent(self) -> set[str]:
        """Requests whose blocks go back to vLLM (its ``finished_sending``)."""
        with self._lock:
            sent, self._sent = self._sent, set()
        return sent

    # ---- vLLM's model thread ----------------------------------------------------------------

    def begin_step(self, meta: PDMetadata) -> None:
        """The pushes of this step's forward pass (once per step: vLLM 0.32 may call
        start_load_kv after the forward pass, whose first save_kv_layer began them)."""
        with self._lock:
            if meta is not self._step_meta:
                self._step_meta = meta
                self._step = [self._begin_push(p) for p in meta.pushes]

    def save_layer(self, meta: PDMetadata, layer: int, ready: Any = None) -> None:
        """Layer ``layer`` is in the blocks, or will be once ``ready`` (a CUDA event recorded
        after the kernels that write it) completes: post it to every decode already streaming.
        The post waits for ``ready`` (``SaveStream.save_layer``'s event), also when the stream
        opens later."""
        with self._lock:
            self.begin_step(meta)
            for out in self._step:
                out.layers.add(layer)
                if ready is not None:
                    out.ready[layer] = ready
                self._post_ready(out)

    def end_forward(self) -> None:
        """Every layer of this step's pushes is in the blocks (also those no save_kv_layer
        reported: an attention backend that does not call it)."""
        with self._lock:
            for out in self._step:
                if out.state is Blocks.COMPUTING:  # else vLLM handed it over already
                    out.computed(self.num_layers)
                    self._post_ready(out)
            self._step = []

    def hold(self, send: SendSpec) -> None:
        """vLLM finished the request and hands its blocks over until ``send.deadline``."""
        logger.debug("kvmove: holding %s (%d blocks)%s", send.req_id, len(send.blocks),
                     " to abort" if send.abort else "")
        with self._lock:
            out = self._out_by_req.get(send.req_id)
            if out is None:
                out = self._track(Outgoing(send.req_id, send.transfer_id or send.req_id,
                                            list(send.blocks), Blocks.COMPUTED))
            out.hold(send.blocks, send.deadline, self.num_layers)
            if send.abort:
                self._abort(out)
            else:
                self._take_reservation(out)
            self._give_back_if_done(out)

    def release_expired(self, now: float) -> None:
        """Leases no decode took up in time; reservations no request came for."""
        with self._lock:
            for out in list(self._out_by_req.values()):
                if out.state is Blocks.HELD and out.waiting and now > out.deadline:
                    logger.info("kvmove: lease of %s ended before %d of its %d decode rank(s) "
                                "asked for it; its %d blocks go back to vLLM once no stream "
                                "reads them", out.key, len(out.waiting), len(out.shares),
                                len(out.blocks))
                    for share in out.waiting:
                        share.skipped()
                    self._give_back_if_done(out)
            horizon = now - self.lease_seconds
            for key, reservations in list(self._reservations.items()):
                if reservations[0].since < horizon:
                    del self._reservations[key]
                    for reservation in reservations:
                        self._decline(reservation.offer, f"no request {key!r} came to this "
                                      f"prefill within {self.lease_seconds:g} s of the offer")

    # ---- offers -----------------------------------------------------------------------------

    def on_offer(self, offer: Offer) -> None:
        """A decode's lease for ``offer.request_id``: streamed into at once if the request is
        known, declined if it is over, else kept as a reservation."""
        logger.debug("kvmove: %s offers %d blocks for %s", offer.peer, len(offer.blocks),
                     offer.request_id)
        try:
            key, share, shares = parse_share(offer.request_id)
        except ConfigError as error:
            self._decline(offer, str(error))
            return
        with self._lock:
            out = self._out.get(key)
            if out is not None:
                self._start_send(out, offer, share, shares)
            elif key in self._done_keys:
                self._decline(offer, "its lease ended or it was sent already")
            elif len(self._reservations) >= MAX_RESERVATIONS:
                self._decline(offer, f"{MAX_RESERVATIONS} reservations are waiting")
            else:
                self._reservations.setdefault(key, []).append(
                    _Reservation(offer, share, shares, time.monotonic()))

    def _decline(self, offer: Offer, reason: str) -> None:
        """Tells the decode its lease will not be streamed into (its load fails at once)."""
        try:
            self.agent.decline(offer, reason)
        except KVMoveError as error:   # it died meanwhile: its lease is gone with it
            logger.warning("kvmove: cannot decline %s of %s: %s", offer.request_id,
                           offer.peer, error)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                offer = self.agent.wait_offer(POLL_SECONDS)
            except kvmove.errors.TimeoutError:
                continue   # none yet, or the agent closed (then _closed is set too)
            self.on_offer(offer)

    # ---- the hand-off -----------------------------------------------------------------------

    def _track(self, out: Outgoing) -> Outgoing:
        self._out[out.key] = out
        self._out_by_req[out.req_id] = out
        return out

    def _begin_push(self, push: PushSpec) -> Outgoing:
        out = self._track(Outgoing(push.req_id, push.transfer_id, list(push.blocks),
                                    Blocks.COMPUTING))
        self._take_reservation(out)
        return out

    def _take_reservation(self, out: Outgoing) -> None:
        for reservation in self._reservations.pop(out.key, []):
            self._start_send(out, reservation.offer, reservation.share, reservation.shares)

    def _start_send(self, out: Outgoing, offer: Offer, share: int = 0, shares: int = 1) -> None:
        """Streams ``out`` into the lease offered for its share ``share`` of ``shares``: every
        layer in the blocks so far at once, the rest as ``save_kv_layer`` saves them."""
        if not out.split(shares):
            self._decline(offer, f"offered as share {share} of {shares}, the request is "
                                 f"being sent to {len(out.shares)} decode rank(s)")
            return
        one = out.shares[share]
        if one.send is not Send.WAITING:
            self._decline(offer, "already sent or aborted")
            return
        stream = self._open_stream(out, offer)
        if stream is None:
            one.skipped()
            self._give_back_if_done(out)
            return
        one.stream_opened(stream)
        one.nbytes = len(offer.blocks) * self.agent.cache.block_nbytes // shares
        self._post_ready(out)

    def _open_stream(self, out: Outgoing, offer: Offer) -> kvmove.SaveStream | None:
        """None when nothing will be streamed: the decode needs nothing (a prefix it has),
        asks for more blocks than the prefill holds (declined), or the stream cannot start."""
        if not offer.blocks:
            return None
        if len(offer.blocks) > len(out.blocks):
            self._decline(offer, f"asked for {len(offer.blocks)} blocks, the prefill holds "
                                 f"{len(out.blocks)}")
            return None
        logger.debug("kvmove: streaming %s to %s (%s, layers so far %s)", out.key, offer.peer,
                     out.state.value, sorted(out.layers))
        src = out.blocks[len(out.blocks) - len(offer.blocks):]
        try:
            return self.agent.stream_to(offer.peer, src, offer.blocks, offer.request_id,
                                        epoch=offer.epoch)
        except KVMoveError as error:   # told at once: its load fails now, not at its deadline
            logger.warning("kvmove: cannot stream %s to %s: %s", out.key, offer.peer, error)
            self._decline(offer, f"the prefill cannot stream into it: {error}")
            return None

    def _post_ready(self, out: Outgoing) -> None:
        """Streams to each share the layers in the blocks not streamed to it yet; finishes a
        share once all are."""
        for one in out.shares:
            if one.send is not Send.STREAMING:
                continue
            assert one.stream is not None
            for layer in sorted(out.layers - one.posted):
                self._guard(one, one.stream.save_layer, layer, out.ready.get(layer))
                one.posted.add(layer)
            if out.state is not Blocks.COMPUTING and len(one.posted) == self.num_layers:
                self._guard(one, one.stream.finish)
                one.closing()
                self._pool.submit(self._await_send, out, one)
        out.forget_ready()

    def _guard(self, one: Share, call: Callable[..., Any], *args: Any) -> None:
        """A stream call; a stream that failed already (its decode died or gave up) is left
        for ``_await_send`` to end."""
        try:
            call(*args)
        except KVMoveError as error:
            logger.debug("kvmove: stream %s: %s", one.key, error)

    def _abort(self, out: Outgoing) -> None:
        """The request did not finish normally: send nothing (more)."""
        for one in out.shares:
            if one.send is Send.WAITING:
                one.skipped()
            elif one.send is not Send.DONE:
                assert one.stream is not None
                one.stream.abort(wait=False)
                if one.send is Send.STREAMING:
                    one.closing()
                    self._pool.submit(self._await_send, out, one)

    def _await_send(self, out: Outgoing, one: Share) -> None:
        assert one.stream is not None
        started = time.monotonic()
        try:
            one.stream.wait_for_save(timeout=self.timeout)
            self.tally.sent(one.nbytes, time.monotonic() - started)
            logger.info("kvmove: sent %s to %s (%d blocks, %d of %d layers during the forward "
                        "pass), acknowledged %.1f ms after the last", out.key, one.stream.peer,
                        len(out.blocks), one.overlapped, self.num_layers,
                        1e3 * (time.monotonic() - started))
        except KVMoveError as error:
            self.tally.count("failed_sends")
            logger.warning("kvmove: sending %s to %s failed: %s%s", out.key, one.stream.peer,
                           error, trouble_note([self.agent]))
            try:
                one.stream.abort(timeout=self.timeout)
            except KVMoveError:
                pass
        with self._lock:
            one.ended()
            self._give_back_if_done(out)

    def _give_back_if_done(self, out: Outgoing) -> None:
        """vLLM gets the blocks back once it handed them to us and no stream reads them."""
        if out.state is not Blocks.HELD or not out.done:
            return
        out.give_back()
        self._sent.add(out.req_id)
        self._lock.notify_all()
        # Only this one: a client may have reused its transfer id for another meanwhile.
        for table, name in ((self._out, out.key), (self._out_by_req, out.req_id)):
            if table.get(name) is out:
                del table[name]
        self._done_keys[out.key] = None
        while len(self._done_keys) > REMEMBER_DONE:
            self._done_keys.popitem(last=False)
