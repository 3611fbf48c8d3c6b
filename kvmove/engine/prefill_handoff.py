"""A prefill worker's KV hand-offs: each request's KV goes, layer by layer, into the blocks
its decode worker leased and offered (``Agent.offer`` there, docs/streaming.md).

The offer comes by kvmove from the decode worker, the request by the router: either may come
first. A request whose offer is here when its last prompt chunk is scheduled streams each
layer as the forward pass writes it; one whose offer is late streams every layer at once when
it comes (within ``timeout`` of the first token, else the request fails). Offers nobody claims
(their request was aborted here, or never came) are declined, so their decode frees its
blocks at once instead of at its lease's deadline.

States of a request here: *expected* (added, where its KV goes is known), *sending* (a stream
is open), *late* (its prompt is computed, its offer has not come).
"""

from __future__ import annotations

import logging
import math
import struct
import time
import uuid
from dataclasses import dataclass

from kvmove.agent import Agent
from kvmove.engine.request import FinishReason, Request
from kvmove.errors import KVMoveError
from kvmove.stream import Offer, SaveStream, StreamState

logger = logging.getLogger(__name__)

__all__ = ["FINAL", "BOOT_ID", "PrefillHandoffs"]

# The final message's payload: the first token, when the prefill computed the last layer
# (time.monotonic()) and its host's boot id: the decode side puts the moment in its timeline
# only when the boot ids say both clocks are one.
FINAL = struct.Struct("<qd16s")


def _boot_id() -> bytes:
    """This boot's id (one CLOCK_MONOTONIC per boot); zeros where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


BOOT_ID = _boot_id()


@dataclass
class _Late:
    request: Request
    token: int
    deadline: float


class PrefillHandoffs:
    """Where a prefill worker's requests' KV goes, and the streams taking it there."""

    def __init__(self, agent: Agent, timeout: float, bytes_per_block: int) -> None:
        self.agent, self.timeout, self.bytes_per_block = agent, timeout, bytes_per_block
        self.sending: dict[str, tuple[Request, SaveStream]] = {}
        self._expected: dict[str, str] = {}          # request id -> its decode worker
        self._offers: dict[tuple[str, str], tuple[Offer, float]] = {}  # (peer, rid) -> since
        self._late: dict[str, _Late] = {}
        self._timed_out: set[str] = set()  # aborted at transfer_timeout, not ended yet

    @property
    def has_work(self) -> bool:
        return bool(self.sending or self._late)

    def expect(self, request: Request, decode_peer: str) -> None:
        """``request``'s KV goes to ``decode_peer``, into the blocks it offers."""
        self._expected[request.id] = decode_peer

    def open(self, requests: list[Request]) -> list[tuple[Request, SaveStream]]:
        """Streams for the requests whose last prompt chunk runs now and whose offer is here;
        the others' first token waits for it (``first_token``)."""
        self._collect(time.monotonic())
        streams = []
        for request in requests:
            if request.id in self.sending or request.id not in self._expected:
                continue
            offer = self._claim(request.id)
            if offer is not None and (stream := self._stream(request, offer)) is not None:
                streams.append((request, stream))
        return streams

    def first_token(self, request: Request, token: int) -> bool:
        """The prompt is computed and ``token`` sampled: the stream ends with it (now, or once
        a late offer came). False when the request failed (its stream could not open)."""
        if request.id in self.sending:
            self._finish(request, token)
            return True
        if request.id in self._expected and not request.error:
            self._late[request.id] = _Late(request, token, time.monotonic() + self.timeout)
            return True
        return False

    def poll(self, now: float) -> list[Request]:
        """The requests whose hand-off ended since, each finished: ``HANDED_OFF`` or
        ``ABORT``. Their blocks are the caller's to free."""
        self._collect(now)
        ended = self._serve_late(now)
        for rid, (request, stream) in list(self.sending.items()):
            if self._ended(request, stream, now):
                del self.sending[rid]
                ended.append(request)
        return ended

    def abort(self, request_id: str) -> Request | None:
        """Stops ``request_id``'s hand-off: its stream aborts (polling ends the request once
        its posted layers landed), or its offer is declined. Returns the request when this
        side holds it beyond the scheduler (sending or late), else None."""
        self._collect(time.monotonic())  # its offer may have come meanwhile: declined too
        self._expected.pop(request_id, None)
        for peer, rid in list(self._offers):
            if rid == request_id:
                self._decline(self._offers.pop((peer, rid))[0], "the request was aborted")
        if request_id in self.sending:
            request, stream = self.sending[request_id]
            stream.abort(wait=False)
            return request
        late = self._late.pop(request_id, None)
        return late.request if late is not None else None

    # --- offers ---------------------------------------------------------------------------

    def _collect(self, now: float) -> None:
        """Takes the agent's new offers; declines those unclaimed for ``timeout``."""
        for offer in self.agent.offers():
            if offer.blocks:  # kvmove-serve's decode workers never offer nothing
                self._offers[offer.peer, offer.request_id] = (offer, now)
        for key, (offer, since) in list(self._offers.items()):
            if now - since > self.timeout and key[1] not in self._expected:
                del self._offers[key]
                self._decline(offer, f"no request {offer.request_id!r} here")

    def _claim(self, request_id: str) -> Offer | None:
        peer = self._expected[request_id]
        entry = self._offers.pop((peer, request_id), None)
        return entry[0] if entry is not None else None

    def _decline(self, offer: Offer, reason: str) -> None:
        try:
            self.agent.decline(offer, reason)
        except KVMoveError as error:  # its peer is gone: so is its lease
            logger.debug("declining %r of %r: %s", offer.request_id, offer.peer, error)

    # --- streams --------------------------------------------------------------------------

    def _stream(self, request: Request, offer: Offer) -> SaveStream | None:
        self._expected.pop(request.id, None)
        try:
            stream = self.agent.stream_to(offer.peer, request.blocks, offer.blocks, request.id,
                                          epoch=offer.epoch)
        except KVMoveError as error:
            request.error = f"cannot stream to {offer.peer!r}: {error}"
            logger.warning("request %r: %s", request.id, request.error)
            return None
        request.timings.kv_start = time.monotonic()
        self.sending[request.id] = (request, stream)
        return stream

    def _finish(self, request: Request, token: int) -> None:
        request.timings.kv_final = time.monotonic()
        last_layer = request.timings.last_layer
        try:
            self.sending[request.id][1].finish(payload=FINAL.pack(
                token, math.nan if last_layer is None else last_layer, BOOT_ID))
        except KVMoveError:
            pass  # the stream failed: polling ends the request

    def _serve_late(self, now: float) -> list[Request]:
        """Late offers that came: every layer streamed at once. Those still missing at their
        deadline fail their request."""
        failed = []
        for rid, late in list(self._late.items()):
            offer = self._claim(rid) if rid in self._expected else None
            if offer is None and now <= late.deadline:
                continue
            del self._late[rid]
            stream = self._stream(late.request, offer) if offer is not None else None
            if stream is None:
                late.request.finish(FinishReason.ABORT, late.request.error or (
                    f"no offer of its KV's blocks came within {self.timeout:g} s"))
                logger.warning("request %r: %s", rid, late.request.error)
                failed.append(late.request)
                continue
            for layer in range(stream.num_layers):
                stream.save_layer(layer)
            self._finish(late.request, late.token)
        return failed

    def _ended(self, request: Request, stream: SaveStream, now: float) -> bool:
        """Whether the stream ended (the request then finished, handed off or aborted)."""
        state, started = stream.state, request.timings.kv_start  # set as it opened (_stream)
        if state == StreamState.OPEN:
            # aborted once: it ends when its posted layers landed or its Final's wait ends (the
            # soak logged and aborted it again at every 1 ms poll, ~1,600 lines a second)
            if started is not None and now - started > self.timeout and \
                    request.id not in self._timed_out:
                self._timed_out.add(request.id)
                logger.warning("request %r: its KV hand-off passed transfer_timeout (%g s); "
                               "aborting it", request.id, self.timeout)
                stream.abort(wait=False)
            return False
        self._timed_out.discard(request.id)
        request.timings.kv_end = now
        request.kv_bytes = len(request.blocks) * self.bytes_per_block
        times = [t for t in stream.layer_times() if None not in t]
        if times and state == StreamState.DONE:
            posted, landed = zip(*times)
            request.kv_seconds = max(landed) - min(posted)
            request.kv_exposed_seconds = max(landed) - max(posted)
            request.timings.kv_sent = max(landed)
        if state == StreamState.DONE:
            request.finish(FinishReason.HANDED_OFF)
        else:
            request.finish(FinishReason.ABORT, stream.error or f"stream {state.name}")
            logger.warning("request %r: KV hand-off failed: %s", request.id, request.error)
        return True
