"""The prefill's part of ``PDWorker``: each request's KV held and streamed into the lease a
decode offers for it.

A request's hand-off (``_Outgoing``) is two small state machines, because two parties drive
it independently:

- its **blocks** (``Blocks``), driven by vLLM::

      COMPUTING --computed--> COMPUTED --hold--> HELD --give_back--> RETURNED
          \\________________hold_______________/^

  COMPUTING only for a push, while the forward pass that completes its prompt runs; a pull's
  request is known from ``hold`` on (``request_finished``: vLLM hands the finished request's
  blocks over until the lease deadline).
- its **send** (``Send``), driven by the decode's offer and the stream::

      WAITING --stream_opened--> STREAMING --closing--> ENDING --ended--> DONE
          \\_______________________skipped___________________________/^

  ``skipped``: nothing will be streamed (an empty offer, a refused one, a stream that could not
  start, the lease over, the request aborted).

The blocks go back to vLLM (``give_back``) exactly when they are HELD and the send is DONE:
vLLM no longer needs them and no stream reads them. Folding the two into one enum would take
their product (4 x 4 states); each transition method asserts the state it leaves.

An offer that arrives before the prefill knows the request (push: both instances got it at
once) waits as a ``_Reservation``, at most ``MAX_RESERVATIONS`` of them and ``lease_seconds``
each, until the forward pass reaches it.

Threads: vLLM's model thread (steps, layers, holds, ``take_sent``), the thread that receives
offers, and the pool threads that wait for streams to end. The ``PDWorker``'s one lock guards
everything here; nothing blocking runs under it.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kvmove
from kvmove.errors import KVMoveError
from kvmove.integrations.vllm.handoff_json import Offer, refuse_message
from kvmove.integrations.vllm.pd_specs import PushSpec, SendSpec

if TYPE_CHECKING:
    from kvmove.integrations.vllm.pd_scheduler import PDMetadata

__all__ = ["Blocks", "PDPrefillWorker", "Send"]

# Under "vllm.": vLLM's handlers print it beside its own lines.
logger = logging.getLogger("vllm.kvmove.pd_prefill")

MAX_RESERVATIONS = 4096        # offers waiting for a request the prefill has not seen yet
REMEMBER_DONE = 65536          # keys of ended sends, so a late offer is declined at once
MESSAGE_SECONDS = 5.0


class Blocks(enum.Enum):
    """Where a request's blocks are (see the module's docstring)."""

    COMPUTING = "computing"    # the forward pass writes their last layers (push)
    COMPUTED = "computed"      # every layer is in them; vLLM still runs the request
    HELD = "held"              # vLLM handed them over until the lease deadline
    RETURNED = "returned"      # given back to vLLM


class Send(enum.Enum):
    """How far a request's KV is on its way to the decode."""

    WAITING = "waiting"        # no decode has offered a lease for it yet
    STREAMING = "streaming"    # a stream into the lease is open; layers post as saved
    ENDING = "ending"          # finish() or abort() went out; a pool thread awaits the end
    DONE = "done"              # no stream reads the blocks (ended, failed, or none started)


@dataclass(eq=False)
class _Outgoing:
    """One request's hand-off, from its forward pass (push) or ``hold`` (pull) until its
    blocks go back to vLLM."""

    req_id: str
    key: str                       # what the decode offers for: transfer id or request id
    blocks: list[int]
    state: Blocks
    send: Send = Send.WAITING
    layers: set[int] = field(default_factory=set)  # in the blocks so far
    posted: set[int] = field(default_factory=set)  # streamed to the decode
    overlapped: int = 0            # layers posted before the forward pass ended
    stream: kvmove.SaveStream | None = None
    deadline: float = float("inf")  # of the lease, once HELD

    def _leave(self, current: enum.Enum, *allowed: enum.Enum) -> None:
        assert current in allowed, f"{self.key}: {current} is not one of {allowed}"

    def computed(self, num_layers: int) -> None:
        self._leave(self.state, Blocks.COMPUTING)
        self.overlapped = len(self.posted)
        self.layers.update(range(num_layers))
        self.state = Blocks.COMPUTED

    def hold(self, blocks: list[int], deadline: float, num_layers: int) -> None:
        self._leave(self.state, Blocks.COMPUTING, Blocks.COMPUTED)
        self.blocks, self.deadline = list(blocks), deadline
        self.layers.update(range(num_layers))
        self.state = Blocks.HELD

    def give_back(self) -> None:
        self._leave(self.state, Blocks.HELD)
        self._leave(self.send, Send.DONE)
        self.state = Blocks.RETURNED

    def stream_opened(self, stream: kvmove.SaveStream) -> None:
        self._leave(self.send, Send.WAITING)
        self.stream, self.send = stream, Send.STREAMING

    def closing(self) -> None:
        self._leave(self.send, Send.STREAMING)
        self.send = Send.ENDING

    def ended(self) -> None:
        self._leave(self.send, Send.ENDING)
        self.send = Send.DONE

    def skipped(self) -> None:
        self._leave(self.send, Send.WAITING)
        self.send = Send.DONE


@dataclass
class _Reservation:
    offer: Offer
    since: float


class PDPrefillWorker:
    """Holds requests' KV for their decodes and streams it into the leases they offer."""

    def __init__(self, agent: kvmove.Agent, num_layers: int, lease_seconds: float,
                 timeout: float, lock: threading.Condition, pool: ThreadPoolExecutor) -> None:
        self.agent = agent
        self.num_layers = num_layers
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        self._lock = lock          # the PDWorker's: notified when blocks go back
        self._pool = pool
        self._out: dict[str, _Outgoing] = {}            # by key
        self._out_by_req: dict[str, _Outgoing] = {}
        self._step: list[_Outgoing] = []                 # pushes in this forward pass
        self._step_meta: PDMetadata | None = None        # whose pushes _step holds
        self._reservations: dict[str, _Reservation] = {}
        self._done_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._sent: set[str] = set()

    @property
    def pending(self) -> bool:
        """Some request's blocks have not gone back yet."""
        return bool(self._out)

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

    def save_layer(self, meta: PDMetadata, layer: int) -> None:
        """Layer ``layer`` is in the blocks: post it to every decode already streaming."""
        with self._lock:
            self.begin_step(meta)
            for out in self._step:
                out.layers.add(layer)
                self._post_ready(out)

    def end_forward(self) -> None:
        """Every layer of this step's pushes is in the blocks (also those no save_kv_layer
        reported: an attention backend that does not call it)."""
        with self._lock:
            for out in self._step:
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
                out = self._track(_Outgoing(send.req_id, send.transfer_id or send.req_id,
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
            for out in list(self._out.values()):
                if out.state is Blocks.HELD and out.send is Send.WAITING and now > out.deadline:
                    logger.info("kvmove: lease of %s ended before a decode asked for it; "
                                "its %d blocks go back to vLLM", out.key, len(out.blocks))
                    out.skipped()
                    self._give_back_if_done(out)
            horizon = now - self.lease_seconds
            for key, reservation in list(self._reservations.items()):
                if reservation.since < horizon:
                    del self._reservations[key]

    # ---- offers -----------------------------------------------------------------------------

    def on_offer(self, offer: Offer) -> None:
        """A decode's lease for ``offer.request_id``: streamed into at once if the request is
        known, declined if it is over, else kept as a reservation."""
        logger.debug("kvmove: %s offers %d blocks for %s", offer.peer, len(offer.blocks),
                     offer.request_id)
        with self._lock:
            out = self._out.get(offer.request_id)
            if out is not None:
                self._start_send(out, offer)
            elif offer.request_id in self._done_keys:
                self._decline(offer, "its lease ended or it was sent already")
            elif len(self._reservations) >= MAX_RESERVATIONS:
                self._decline(offer, f"{MAX_RESERVATIONS} reservations are waiting")
            else:
                self._reservations[offer.request_id] = _Reservation(offer, time.monotonic())

    def _decline(self, offer: Offer, reason: str) -> None:
        """The seam of the refusal: tells the decode its offer will not be streamed into."""
        self._pool.submit(self._notify, offer.peer,
                          refuse_message(offer.request_id, reason))

    def _notify(self, peer: str, message: bytes) -> None:
        try:
            self.agent.write(peer, [], [], notify=message).wait(MESSAGE_SECONDS)
        except KVMoveError as error:
            logger.warning("kvmove: message to %s lost: %s", peer, error)

    # ---- the hand-off -----------------------------------------------------------------------

    def _track(self, out: _Outgoing) -> _Outgoing:
        self._out[out.key] = out
        self._out_by_req[out.req_id] = out
        return out

    def _begin_push(self, push: PushSpec) -> _Outgoing:
        out = self._track(_Outgoing(push.req_id, push.transfer_id, list(push.blocks),
                                    Blocks.COMPUTING))
        self._take_reservation(out)
        return out

    def _take_reservation(self, out: _Outgoing) -> None:
        reservation = self._reservations.pop(out.key, None)
        if reservation is not None:
            self._start_send(out, reservation.offer)

    def _start_send(self, out: _Outgoing, offer: Offer) -> None:
        """Streams ``out`` into the offered lease: every layer in the blocks so far at once,
        the rest as ``save_kv_layer`` saves them."""
        if out.send is not Send.WAITING:
            self._decline(offer, "already sent or aborted")
            return
        stream = self._open_stream(out, offer)
        if stream is None:
            out.skipped()
            self._give_back_if_done(out)
            return
        out.stream_opened(stream)
        self._post_ready(out)

    def _open_stream(self, out: _Outgoing, offer: Offer) -> kvmove.SaveStream | None:
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
            return self.agent.stream_to(offer.peer, src, offer.blocks, out.key,
                                        epoch=offer.epoch)
        except KVMoveError as error:
            logger.warning("kvmove: cannot stream %s to %s: %s", out.key, offer.peer, error)
            return None

    def _post_ready(self, out: _Outgoing) -> None:
        """Streams the layers in the blocks not streamed yet; finishes once all are."""
        if out.send is not Send.STREAMING:
            return
        assert out.stream is not None
        for layer in sorted(out.layers - out.posted):
            self._guard(out, out.stream.save_layer, layer)
            out.posted.add(layer)
        if out.state is not Blocks.COMPUTING and len(out.posted) == self.num_layers:
            self._guard(out, out.stream.finish)
            out.closing()
            self._pool.submit(self._await_send, out)

    def _guard(self, out: _Outgoing, call: Callable[..., Any], *args: Any) -> None:
        """A stream call; a stream that failed already (its decode died or gave up) is left
        for ``_await_send`` to end."""
        try:
            call(*args)
        except KVMoveError as error:
            logger.debug("kvmove: stream %s: %s", out.key, error)

    def _abort(self, out: _Outgoing) -> None:
        """The request did not finish normally: send nothing (more)."""
        if out.send is Send.WAITING:
            out.skipped()
        elif out.send is not Send.DONE:
            assert out.stream is not None
            out.stream.abort(wait=False)
            if out.send is Send.STREAMING:
                out.closing()
                self._pool.submit(self._await_send, out)

    def _await_send(self, out: _Outgoing) -> None:
        assert out.stream is not None
        started = time.monotonic()
        try:
            out.stream.wait_for_save(timeout=self.timeout)
            logger.info("kvmove: sent %s (%d blocks, %d of %d layers during the forward "
                        "pass), acknowledged %.1f ms after the last", out.key, len(out.blocks),
                        out.overlapped, self.num_layers, 1e3 * (time.monotonic() - started))
        except KVMoveError as error:
            logger.warning("kvmove: sending %s to %s failed: %s", out.key, out.stream.peer,
                           error)
            try:
                out.stream.abort(timeout=self.timeout)
            except KVMoveError:
                pass
        with self._lock:
            out.ended()
            self._give_back_if_done(out)

    def _give_back_if_done(self, out: _Outgoing) -> None:
        """vLLM gets the blocks back once it handed them to us and no stream reads them."""
        if out.state is not Blocks.HELD or out.send is not Send.DONE:
            return
        out.give_back()
        self._sent.add(out.req_id)
        self._lock.notify_all()
        self._out.pop(out.key, None)
        self._out_by_req.pop(out.req_id, None)
        self._done_keys[out.key] = None
        while len(self._done_keys) > REMEMBER_DONE:
            self._done_keys.popitem(last=False)
