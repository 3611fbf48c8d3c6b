"""Receiving KV from a peer of another layout: stage it in the sender's layout, convert it on
arrival into the receiver's cache (docs/engines.md, "Peers that differ").

Two agents whose layouts differ are refused by ``Agent`` before any byte moves. A receiver that
expects KV from a prefill of another block size, head order (NHD/HND) or dtype opens a
``StagingArea`` for that sender's layout: a small ``KVCache`` in the sender's layout, behind an
agent of its own. The sender connects to that agent and writes or streams into its blocks
exactly as into an identical peer (the identity path: one-sided puts of runs, leases,
checksums, all unchanged); the receiver converts each layer into its own blocks with
``kvmove.convert`` once it has landed, then frees the staging blocks::

    prefill (sender layout) --put--> staging blocks (sender layout) --convert--> decode cache
                                     \\_____________ receiver's process _____________/

Why the receiver converts rather than the sender packing into the receiver's layout: the
sender's write stays a plain put of its own blocks (no pack buffer, no extra pass on the
prefill GPU, which is the busier side), the conversion runs where the result is needed, and
it overlaps the next layer's arrival in a layer stream. It costs the receiver one staging block
per block in flight and one conversion pass over the bytes.

Staging room is bounded (``num_blocks``): ``reserve`` and ``expect`` return None when the
request does not fit right now (back-pressure), never allocate more.

Example (decode side, a layer stream)::

    area = kvmove.StagingArea("decode-0/staging", cache, sender_layout=prefill_layout,
                              sender_order="HND", num_blocks=256)
    area.agent.listen()                       # the prefill connects here, not to decode-0
    load = area.expect("prefill-0", "req-42", dst_ids, num_tokens)   # None: no room yet
    # tell the prefill load.epoch and load.staging_ids (its remote_ids)
    load.start_load()
    for layer in range(num_layers):
        load.wait_for_layer(layer, timeout=5.0)   # layer converted into dst_ids: read it
    load.wait_all(timeout=5.0)                    # staging blocks freed
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from kvmove.agent import Agent
from kvmove.convert import convert
from kvmove.errors import ConfigError
from kvmove.kv_cache import HEAD_ORDERS, KVCache, check_kv_heads
from kvmove.kv_spec import KVSpec
from kvmove.stream import DEFAULT_TIMEOUT, LoadStream, StreamState
from kvmove.validation import require_positive_int

__all__ = ["StagedLoad", "StagedWrite", "StagingArea"]


class StagingArea:
    """Staging blocks in one sender's layout, behind an agent of their own, converted on
    arrival into ``cache``.

    Example:
        >>> area = kvmove.StagingArea("decode-0/staging", cache, sender_layout=prefill_layout,
        ...                           sender_order="HND", num_blocks=256, transports="tcp")
        >>> area.agent.listen()        # the prefill connects to the staging agent
        >>> staged = area.reserve(num_tokens)     # None: no staging room right now

    Args:
        name: the staging agent's name: the one the sender connects and writes to.
        cache: the receiver's own cache, converted into: a ``KVCache`` or a wrapped engine
            cache (K and V of a block together or in planes of their own), order NHD, HND or
            vllm-cpu.
        sender_layout: the sender's ``KVSpec``: same layers, heads and head_dim as
            ``cache``'s; block size and dtype may differ.
        sender_order: the sender's element order inside a block, "NHD", "HND" or "vllm-cpu".
        num_blocks: staging blocks (of the sender's block size): what may be in flight at once.
        sender_kv_heads: ``(first, total)``: the sender is a tensor-parallel rank holding the
            model's heads ``[first, first + sender_layout.num_kv_heads)`` of ``total`` (its
            ``Agent(kv_heads=...)``); None: every head.
        kv_heads: the same for ``cache`` (this decode rank's heads); None: every head. The
            heads both hold are converted; ``cache``'s others keep their bytes (a TP=2 prefill
            into a TP=1 decode: one area per prefill rank, each filling its half).
        **agent_kwargs: for the staging ``Agent`` (transports, key, host, checksums, ...).

    Raises:
        ConfigError: layouts that cannot convert (naming the field and both values), or
            identical ones (they need no staging: use the cache's own agent).
    """

    def __init__(self, name: str, cache: KVCache, *, sender_layout: KVSpec,
                 sender_order: str = "NHD", num_blocks: int,
                 sender_kv_heads: tuple[int, int] | None = None,
                 kv_heads: tuple[int, int] | None = None, **agent_kwargs: Any) -> None:
        require_positive_int("num_blocks", num_blocks)
        self.sender_kv_heads = check_kv_heads(sender_layout, sender_kv_heads)
        self.kv_heads = check_kv_heads(cache.layout, kv_heads)
        check_convertible(sender_layout, sender_order, self.sender_kv_heads, cache, self.kv_heads)
        self.cache = cache
        self.staging = KVCache(sender_layout, num_blocks, order=sender_order,
                               device=None if cache.device == "cpu" else cache.device)
        self.agent = Agent(name, self.staging, kv_heads=self.sender_kv_heads, **agent_kwargs)
        self._releasing: list[tuple[LoadStream, list[int]]] = []
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Staging blocks free now (after taking back those of released loads)."""
        self._reclaim()
        assert self.staging.pool is not None
        return self.staging.pool.num_free

    def reserve(self, num_tokens: int) -> StagedWrite | None:
        """Staging blocks for ``num_tokens`` tokens that the sender will ``write``; None when
        they do not fit right now."""
        ids = self._allocate(num_tokens)
        return None if ids is None else StagedWrite(self, ids, num_tokens)

    def expect(self, peer: str, request_id: str, dst_ids: Sequence[int], num_tokens: int, *,
               timeout: float = 60.0) -> StagedLoad | None:
        """``Agent.expect`` on staging blocks for ``num_tokens`` tokens, to be converted into
        ``dst_ids`` of ``cache`` layer by layer; None when they do not fit right now.

        Raises:
            ConfigError: ``dst_ids`` do not hold ``num_tokens`` in ``cache``'s block size, and
                what ``Agent.expect`` raises.
        """
        return self._lease(self.agent.expect, peer, request_id, dst_ids, num_tokens, timeout)

    def offer(self, peer: str, request_id: str, dst_ids: Sequence[int], num_tokens: int, *,
              timeout: float = 60.0) -> StagedLoad | None:
        """``Agent.offer`` of staging blocks for ``num_tokens`` tokens (the hand-off's first
        message: ``peer`` streams into them), converted into ``dst_ids`` of ``cache`` layer by
        layer; the load is started. None when they do not fit right now.

        Raises:
            ConfigError: ``dst_ids`` do not hold ``num_tokens`` in ``cache``'s block size, and
                what ``Agent.offer`` raises.
        """
        return self._lease(self.agent.offer, peer, request_id, dst_ids, num_tokens, timeout)

    def _lease(self, lease: Callable[..., LoadStream | None], peer: str, request_id: str,
               dst_ids: Sequence[int], num_tokens: int, timeout: float) -> StagedLoad | None:
        """``lease`` (the agent's expect or offer) on staging blocks for ``num_tokens``
        tokens; their blocks back if it raises; None when they do not fit right now."""
        _check_covers("dst_ids", len(dst_ids), num_tokens, self.cache.layout.block_size)
        ids = self._allocate(num_tokens)
        if ids is None:
            return None
        try:
            stream = lease(peer, request_id, ids, timeout=timeout)
        except BaseException:
            self._free(ids)
            raise
        assert stream is not None  # ids is not empty
        return StagedLoad(self, stream, list(dst_ids), num_tokens)

    def close(self) -> None:
        """Closes the staging agent (its loads fail)."""
        self.agent.close()

    def convert_layers(self, staging_ids: list[int], dst_ids: Sequence[int], num_tokens: int,
                       layers: Sequence[int] | None = None) -> None:
        """Converts ``layers`` (all when None) of the staged tokens into ``dst_ids``."""
        convert(self.staging, staging_ids, self.cache, list(dst_ids), num_tokens,
                layers=layers, src_order=self.staging.order, dst_order=self.cache.order,
                src_heads=self.sender_kv_heads, dst_heads=self.kv_heads)

    def _allocate(self, num_tokens: int) -> list[int] | None:
        require_positive_int("num_tokens", num_tokens)
        self._reclaim()
        assert self.staging.pool is not None
        need = self.staging.layout.blocks_for(num_tokens)
        if need > self.staging.num_blocks:
            raise ConfigError(f"{num_tokens} tokens need {need} staging blocks, the staging "
                              f"area has {self.staging.num_blocks} (num_blocks): it never fits")
        return self.staging.pool.allocate(need)

    def _free(self, ids: list[int]) -> None:
        assert self.staging.pool is not None
        self.staging.pool.free(ids)

    def _release_later(self, stream: LoadStream, staging_ids: list[int]) -> None:
        """Takes an ended (or dropped: cancelled here) load's staging blocks back once no byte
        can land in them any more."""
        if stream.state == StreamState.OPEN:
            stream.cancel()
        with self._lock:
            self._releasing.append((stream, staging_ids))
        self._reclaim()

    def _reclaim(self) -> None:
        with self._lock:
            ended = [(entry, entry[0].released) for entry in self._releasing]
            self._releasing = [entry for entry, released in ended if not released]
        for (_, ids), released in ended:
            if released:
                self._free(ids)

    def __repr__(self) -> str:
        return (f"StagingArea({self.agent.name!r}, {self.staging.layout!r} "
                f"{self.staging.order} -> {self.cache.layout!r} {self.cache.order})")


class StagedWrite:
    """Staging blocks that a sender fills with one ``Agent.write`` (made by
    ``StagingArea.reserve``): tell it ``staging_ids`` (its remote ids), then ``finish``.

    Example:
        >>> staged = area.reserve(num_tokens)              # None: no room right now
        >>> # the sender: agent.write("decode-0/staging", ids, staged.staging_ids, notify=b"r")
        >>> area.agent.wait_notification(timeout=5.0)      # every byte is in staging
        >>> staged.finish(dst_ids)                         # converted; staging blocks freed
    """

    def __init__(self, area: StagingArea, staging_ids: list[int], num_tokens: int) -> None:
        self.area = area
        self.staging_ids = staging_ids
        self.num_tokens = num_tokens
        self._open = True

    def finish(self, dst_ids: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """Converts the staged ``layers`` (all when None) into ``dst_ids`` of the receiver's
        cache, then frees the staging blocks. Call it once the write has landed.

        Raises:
            ConfigError: already finished or released, or ``dst_ids`` do not hold
                ``num_tokens``.
        """
        self._check_open()
        _check_covers("dst_ids", len(dst_ids), self.num_tokens,
                      self.area.cache.layout.block_size)
        try:
            self.area.convert_layers(self.staging_ids, dst_ids, self.num_tokens, layers)
        finally:
            self.release()

    def release(self) -> None:
        """Frees the staging blocks without converting (the write failed). Idempotent."""
        if self._open:
            self._open = False
            self.area._free(self.staging_ids)

    def _check_open(self) -> None:
        if not self._open:
            raise ConfigError("this staged write is finished or released: its staging blocks "
                              "may hold another request's KV")


class StagedLoad:
    """A layer stream received into staging blocks and converted layer by layer into
    ``local_ids`` of the receiver's cache (made by ``StagingArea.expect``).

    The sender streams into ``staging_ids`` (tell it ``epoch`` and ``staging_ids``). A layer is
    reported ready (``wait_for_layer``) only once it is converted, so an engine never reads an
    unconverted layer; the conversion runs in the waiting thread, while later layers arrive.
    The staging blocks are freed once the stream is released after ``wait_all`` or ``cancel``.

    Example:
        >>> load = area.expect("prefill-0", "req-42", dst_ids, num_tokens).start_load()
        >>> # the sender: stream_to(area.agent.name, ids, load.staging_ids, "req-42",
        >>> #                       epoch=load.epoch)
        >>> load.wait_for_layer(0, timeout=5.0)   # layer 0 is in dst_ids, converted
        >>> load.wait_all(timeout=5.0)            # every layer; staging blocks freed
    """

    def __init__(self, area: StagingArea, stream: LoadStream, dst_ids: list[int],
                 num_tokens: int) -> None:
        self.area = area
        self.stream = stream
        self.local_ids = dst_ids
        self.staging_ids = stream.local_ids
        self.num_tokens = num_tokens
        self._converted = [False] * stream.num_layers
        self._lock = threading.Lock()
        # Runs once: at wait_all or cancel, or when the load is dropped unfinished (it is then
        # cancelled); the area frees the staging blocks once the sender stopped.
        self._end = weakref.finalize(self, area._release_later, stream, self.staging_ids)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def start_load(self) -> StagedLoad:
        """``LoadStream.start_load``: the waits may be called from now on."""
        self.stream.start_load()
        return self

    def wait_for_layer(self, layer: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Returns once layer ``layer`` is converted into ``local_ids``.

        Raises:
            TimeoutError: the layer is not in within ``timeout``.
            TransferError: the load failed or was cancelled (as ``LoadStream.wait_for_layer``).
            PeerError: the sender is gone.
        """
        self.stream.wait_for_layer(layer, timeout)
        self._convert(layer)

    def wait_all(self, timeout: float = DEFAULT_TIMEOUT) -> bytes:
        """``LoadStream.wait_all``, then converts the layers not converted yet and frees the
        staging blocks; returns the final payload.

        Raises:
            TimeoutError: the load is not complete within ``timeout``.
            ChecksumError: a block's bytes did not match (nothing more is converted).
            TransferError: the load failed or was cancelled (as ``LoadStream.wait_all``).
            PeerError: the sender is gone.
        """
        payload = self.stream.wait_all(timeout)
        for layer in range(len(self._converted)):
            self._convert(layer)
        self._end()
        return payload

    def layers_ready(self) -> list[bool]:
        """Per layer: converted into ``local_ids``."""
        with self._lock:
            return list(self._converted)

    def cancel(self) -> None:
        """``LoadStream.cancel``; the staging blocks are freed once the sender stopped."""
        self.stream.cancel()
        self._end()

    def _convert(self, layer: int) -> None:
        with self._lock:
            if self._converted[layer]:
                return
            self.area.convert_layers(self.staging_ids, self.local_ids, self.num_tokens, [layer])
            self._converted[layer] = True

    def __repr__(self) -> str:
        return (f"StagedLoad({self.stream.request_id!r} <- {self.stream.peer!r}, "
                f"{sum(self.layers_ready())}/{len(self._converted)} layers converted)")


def check_convertible(sender_layout: KVSpec, sender_order: str,
                      sender_heads: tuple[int, int], cache: KVCache,
                      heads: tuple[int, int]) -> None:
    """Raises ConfigError unless blocks of ``sender_layout`` in ``sender_order`` holding
    ``sender_heads`` (first, total) convert into ``cache`` holding ``heads`` (and differ)."""
    here = cache.layout
    for field in ("num_layers", "head_dim", "mla"):
        ours, theirs = getattr(here, field), getattr(sender_layout, field)
        if ours != theirs:
            raise ConfigError(f"KV layouts cannot convert: {field}: {ours} here, {theirs} at "
                              f"the sender (another model)")
    _check_heads(sender_layout, sender_heads, here, heads)
    for side, order in (("sender_order", sender_order), ("the cache's order", cache.order)):
        if order not in HEAD_ORDERS:
            raise ConfigError(f"KV layouts cannot convert: {side} must be one of "
                              f"{HEAD_ORDERS}, got {order!r}")
    if "vllm-cpu" in (sender_order, cache.order) and (
            sender_order, sender_layout.block_size, sender_layout.dtype) != (
            cache.order, here.block_size, here.dtype):
        raise ConfigError(f"KV layouts cannot convert: vllm-cpu blocks convert only into "
                          f"vllm-cpu blocks of the same block size and dtype (heads split or "
                          f"merged; vLLM's CPU kernels own the order inside a head), got "
                          f"{sender_order} {sender_layout.block_size} {sender_layout.dtype} "
                          f"into {cache.order} {here.block_size} {here.dtype}")
    for side, dtype in (("the sender's", sender_layout.dtype), ("the cache's", here.dtype)):
        if dtype == "float8":
            raise ConfigError(f"KV layouts cannot convert on arrival: {side} dtype is float8, "
                              "whose per-block scales staging does not carry (not built yet)")
    if (sender_layout.block_size, sender_layout.dtype, sender_order, sender_heads,
            sender_layout.num_kv_heads) == (here.block_size, here.dtype, cache.order, heads,
                                            here.num_kv_heads):
        raise ConfigError("the sender's layout is the cache's own: no staging needed, expect "
                          "on the cache's agent")


def _check_heads(sender_layout: KVSpec, sender_heads: tuple[int, int], here: KVSpec,
                 heads: tuple[int, int]) -> None:
    """Both sides split the same model's heads, and hold some in common."""
    if sender_heads[1] != heads[1]:
        raise ConfigError(f"KV layouts cannot convert: the model's KV heads: {heads[1]} here, "
                          f"{sender_heads[1]} at the sender (another model, or kv_heads "
                          f"missing on one side: num_kv_heads {here.num_kv_heads} here, "
                          f"{sender_layout.num_kv_heads} at the sender)")
    first = max(sender_heads[0], heads[0])
    end = min(sender_heads[0] + sender_layout.num_kv_heads, heads[0] + here.num_kv_heads)
    if first >= end:
        raise ConfigError(f"KV layouts cannot convert: the sender holds KV heads "
                          f"[{sender_heads[0]}, {sender_heads[0] + sender_layout.num_kv_heads})"
                          f", this cache [{heads[0]}, {heads[0] + here.num_kv_heads}): none in "
                          f"common")


def _check_covers(what: str, num_ids: int, num_tokens: int, block_size: int) -> None:
    require_positive_int("num_tokens", num_tokens)
    need = -(-num_tokens // block_size)
    if num_ids != need:
        raise ConfigError(f"{what} has {num_ids} blocks, {num_tokens} tokens take {need} of "
                          f"{block_size} tokens")
