"""Layer-wise streaming: send each layer's KV as the forward pass computes it, into blocks the
receiver leased for it.

The verbs are vLLM's KV-connector verbs, so an engine author knows where each one goes::

    # decode side: lease the blocks              # prefill side
    load = agent.expect("prefill-0", "req-7",
                        dst_ids, timeout=30.0)
    # -> load.epoch and dst_ids to the prefill (the control plane: a router, kv_transfer_params)
                                                 stream = agent.stream_to("decode-0", src_ids,
                                                     dst_ids, "req-7", epoch=epoch)
    load.start_load()                            for i, layer in enumerate(model.layers):
    for i, layer in enumerate(model.layers):         hidden = layer(hidden)  # writes KV
        load.wait_for_layer(i)                       stream.save_layer(i)    # non-blocking
        hidden = layer(hidden)  # reads KV       stream.finish(payload=token_bytes)
    first = load.wait_all()  # the payload       stream.wait_for_save()
    ...                                          # its blocks are the prefill's again
    load.wait_released(); pool.free(dst_ids)  # only when the request is over

``save_layer(i)`` posts layer ``i``'s coalesced puts and returns; when they have landed in the
decode side's blocks the sender tells the receiver, and only then does ``wait_for_layer(i)``
return there. The sender writes nothing before the receiver said yes to its lease: a late
sender of a cancelled or expired lease writes 0 bytes. A lease's blocks may be reused only
once ``load.released`` (the sender ended, or is gone): a timeout alone never frees them. See
docs/streaming.md for the protocol, the timeline and the failure rules.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

from kvmove import _C
from kvmove.errors import ConfigError, PeerError, TransferError

__all__ = ["LoadStream", "Offer", "SaveStream", "StreamState"]

StreamState = _C.StreamState
"""A layer stream's state: OPEN, then DONE, ABORTED (by its sender) or FAILED.

Example:
    >>> load = agent.expect(peer, "req-42", ids).start_load()
    >>> load.state                        # StreamState.OPEN until the final message
    >>> load.wait_all(timeout=5.0)        # the payload; raises if ABORTED or FAILED
    >>> load.state is kvmove.StreamState.DONE
    True
"""

DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Offer:
    """A peer's lease, offered to this agent: "request ``request_id``'s KV goes into my
    ``blocks`` under lease ``epoch``" (the decode side's ``Agent.offer``). Stream into it with
    ``Agent.stream_to(offer.peer, src_ids, offer.blocks, offer.request_id,
    epoch=offer.epoch)``, or decline it (``Agent.decline``).

    An offer of no blocks (``epoch`` 0) says the peer needs none of that request's KV: let its
    blocks go.

    Attributes:
        peer: the agent that leased the blocks (it sent the offer; attributed by its
            connection, never by a name in the message).
        request_id: the key both sides know the request by.
        epoch: the lease (``LoadStream.epoch`` on the peer); 0 with no blocks.
        blocks: the peer's leased block ids, in the order the KV goes into them.

    Example:
        >>> offer = agent.wait_offer(timeout=5.0)           # the prefill side
        >>> if offer.blocks:
        ...     stream = agent.stream_to(offer.peer, src_ids[-len(offer.blocks):],
        ...                              offer.blocks, offer.request_id, epoch=offer.epoch)
    """

    peer: str
    request_id: str
    epoch: int
    blocks: tuple[int, ...]

    @classmethod
    def _from_core(cls, core: Any) -> Offer:
        return cls(core.peer, core.request_id, core.epoch, tuple(core.block_ids))

    def _core(self) -> Any:
        return _C.Offer(self.peer, self.request_id, self.epoch, list(self.blocks))
_MAX_HANDLE = 2**64 - 1  # a cudaEvent_t is a pointer


def _event_handle(event: Any) -> int:
    """A cudaEvent_t as an int: from None (no event), an int, or an object with ``cuda_event``."""
    if event is None:
        return 0
    handle = getattr(event, "cuda_event", event)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise ConfigError(
            f"event must be a CUDA event handle (int) or have a cuda_event attribute, "
            f"got {type(event).__name__}")
    if not 0 < handle <= _MAX_HANDLE:
        raise ConfigError(f"CUDA event handle must be in [1, 2**64), got {handle}")
    return handle


def _timings(core: Any) -> list[tuple[float | None, float | None]]:
    return [(_moment(start), _moment(end)) for start, end in core.layer_times()]


def _moment(t: float) -> float | None:
    """The core's NaN (not happened) as None."""
    return None if math.isnan(t) else t


def _abort_if_open(core: Any) -> None:
    if core.state == StreamState.OPEN:
        core.abort()


def _cancel_if_open(core: Any) -> None:
    if core.state == StreamState.OPEN:
        core.cancel()


class _Stream:
    """What both halves of a stream show: who, which request, how far."""

    _core: Any

    @property
    def peer(self) -> str:
        return self._core.peer

    @property
    def request_id(self) -> str:
        return self._core.request_id

    @property
    def num_layers(self) -> int:
        return self._core.num_layers

    @property
    def state(self) -> StreamState:
        return self._core.state

    @property
    def error(self) -> str:
        """Why it failed; empty unless FAILED."""
        return self._core.error

    @property
    def epoch(self) -> int:
        """The receiver's lease this stream fills (unique per receiving agent)."""
        return self._core.epoch


class SaveStream(_Stream):
    """The sending half of one request's layer stream (made by ``Agent.stream_to``).

    A stream dropped while still open is aborted, so its receiver is told instead of waiting
    for a final message that will never come.

    Example:
        >>> stream = agent.stream_to(peer, ids, remote_ids, "req-42")
        >>> for i, layer in enumerate(model.layers):
        ...     hidden = layer(hidden)          # writes layer i's KV into the cache
        ...     stream.save_layer(i)            # queued: posted while layer i+1 computes
        >>> stream.finish(payload=first_token)  # bytes, sent once every layer landed
        >>> stream.wait_for_save(timeout=5.0)
    """

    def __init__(self, core: _C.SaveStream, agent: Any) -> None:
        self._core = core
        self._agent = agent  # the agent must outlive its streams
        self._closing = False  # finish() or abort() was called
        # The events handed to save_layer: a torch.cuda.Event destroys its cudaEvent_t when
        # collected, and the core may still be polling it. Kept as long as the stream.
        self._events: list[Any] = []
        weakref.finalize(self, _abort_if_open, core)

    def save_layer(self, layer: int, event: Any = None) -> None:
        """Posts layer ``layer``'s puts and returns at once.

        Args:
            layer: in ``[0, num_layers)``; each layer is saved exactly once, in any order.
            event: CUDA builds only: a CUDA event (``torch.cuda.Event``, anything with a
                ``cuda_event`` handle, or the raw handle) recorded after the layer's KV was
                written. A core thread waits for it and then posts, so the GPU and Python never
                wait for each other. The stream keeps the event object alive; a raw handle
                must stay valid until the stream ends.

        Raises:
            ConfigError: layer out of range, saved twice, or after ``finish``/``abort``.
            CudaError: an event given to a build without CUDA.
            PeerError/TransferError: the stream already failed.
        """
        self._core.save_layer(layer, _event_handle(event))
        if event is not None and not isinstance(event, int):
            self._events.append(event)

    def finish(self, payload: bytes = b"") -> None:
        """Closes the stream: once every layer landed, the final message carries ``payload``
        (up to 64 KiB, e.g. the first sampled token) to the receiver. Non-blocking.

        Raises:
            ConfigError: a layer was never saved, the payload is too large, or the stream was
                already finished or aborted.
        """
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ConfigError(f"payload must be bytes, got {type(payload).__name__}")
        self._core.finish(bytes(payload))
        self._closing = True

    def wait_for_save(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Returns once every layer landed and the receiver acknowledged the final message.

        Calls ``finish()`` (no payload) first if it was not called.

        Raises:
            TimeoutError: not done within ``timeout`` seconds, or the receiver did not
                acknowledge the final message within the agent's ``ack_timeout`` (the stream
                has then failed: this side's blocks are free to reuse).
            TransferError: the stream was aborted or cancelled by its receiver, the receiver
                refused the lease (nothing was written), or a transfer failed.
            PeerError: the receiver died or was removed.
        """
        _C.check_timeout(timeout)  # before finish(): a rejected call changes nothing
        if not self._closing:
            self.finish()
        if self._core.wait(timeout) == StreamState.ABORTED:
            raise TransferError(self._core.error or
                                f"stream of request {self.request_id!r} to {self.peer!r} was "
                                "aborted")

    def abort(self, timeout: float = DEFAULT_TIMEOUT, wait: bool = True) -> None:
        """Stops the stream and tells the receiver the request is cancelled.

        No further layer is posted. Returns once the layers already posted have landed (so
        nothing more will be written into the receiver's blocks, and this side's blocks are
        free to reuse) and the abort message is out. Does nothing when the stream already
        ended; a final message already on its way is not recalled.

        With ``wait=False`` it returns at once; ``state`` then tells when it is ABORTED.

        Raises:
            TimeoutError: posted layers still in flight after ``timeout`` seconds.
        """
        _C.check_timeout(timeout)
        self._closing = True
        self._core.abort()
        if not wait:
            return
        try:
            self._core.wait(timeout)
        except (TransferError, PeerError):
            pass  # it failed: nothing more will be written either

    def layer_times(self) -> list[tuple[float | None, float | None]]:
        """Per layer, ``(posted, landed)`` on the ``time.monotonic()`` clock; None until then."""
        return _timings(self._core)

    def __repr__(self) -> str:
        return (f"SaveStream({self.request_id!r} -> {self.peer!r}, "
                f"{self.num_layers} layers, {self.state.name})")


class LoadStream(_Stream):
    """The receiving half of one request's layer stream, and the lease of its blocks (made by
    ``Agent.expect``).

    A load dropped while still open is cancelled.

    Example:
        >>> load = agent.expect(peer, "req-42", ids).start_load()
        >>> load.wait_for_layer(0, timeout=5.0)   # layer 0 of every block in ids is there
        >>> first_token = load.wait_all(timeout=5.0)
    """

    def __init__(self, core: _C.LoadStream, agent: Any) -> None:
        self._core = core
        self._agent = agent
        weakref.finalize(self, _cancel_if_open, core)


    @property
    def local_ids(self) -> list[int]:
        return self._core.local_ids

    @property
    def payload(self) -> bytes:
        """The final message's payload (empty until it arrived)."""
        return self._core.payload

    @property
    def released(self) -> bool:
        """True once no byte of this stream can land in its blocks any more: the sender ended
        it (after its last put landed), the sender is gone, or it never began. Only then may
        the blocks be reused; a load that failed or was cancelled may take a while longer."""
        return self._core.released

    def wait_released(self, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """Returns True once ``released``, False if ``timeout`` seconds pass first."""
        return self._core.wait_released(timeout)

    def bad_blocks(self) -> list[int]:
        """Blocks whose bytes did not match the sender's checksums (streams sent with
        ``checksums=True``): their KV must not be used."""
        return self._core.bad_blocks()

    def start_load(self) -> LoadStream:
        """Starts receiving (vLLM's ``start_load_kv``): the waits may be called from now on.

        The lease exists from ``Agent.expect`` on, so a sender faster than this call loses
        nothing: its layers are recorded as they land.

        Raises:
            ConfigError: called twice, or another load of the same request is running.
            PeerError: the sender is dead.
        """
        self._core.start_load()
        return self

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Returns once layer ``layer``'s bytes are all in this load's blocks.

        Raises:
            TimeoutError: not there within ``timeout`` seconds.
            TransferError: the sender aborted the request, or the load was cancelled.
            PeerError: the sender died or was removed.
        """
        self._core.wait_for_layer(layer, timeout)

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> bytes:
        """Returns the final message's payload once every layer (verified, when the sender sent
        checksums) and the final are in.

        Raises:
            TimeoutError: not complete within ``timeout`` seconds.
            ChecksumError: some blocks' bytes do not match the sender's checksums
                (``bad_blocks()`` names them).
            TransferError: the sender aborted, or the load was cancelled or its lease expired.
            PeerError: the sender died or was removed.
        """
        return self._core.wait_all(timeout)

    def layers_ready(self) -> list[bool]:
        return self._core.layers_ready()

    def layer_times(self) -> list[float | None]:
        """Per layer, when its ready message arrived (``time.monotonic()`` clock), or None."""
        return [landed for _, landed in _timings(self._core)]

    def cancel(self) -> None:
        """Cancels the lease: waiters get TransferError at once, and the sender is told to
        stop. The blocks are released (``released``) once it answered, or, if it does not
        within the agent's ``cancel_timeout``, once it has been disconnected."""
        self._core.cancel()

    def __repr__(self) -> str:
        return (f"LoadStream({self.request_id!r} <- {self.peer!r}, "
                f"{sum(self.layers_ready())}/{self.num_layers} layers, {self.state.name})")
