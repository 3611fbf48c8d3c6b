"""Layout work on KV blocks, on the memory the cache lives in (host C++ or CUDA kernels):

* ``pack`` / ``unpack``: scattered blocks of some layers <-> one contiguous buffer, for
  transports or tiers that prefer one large message;
* ``convert``: a sequence's tokens from one cache into another of a different block size
  (16 <-> 64 tokens per block...), head order (NHD <-> HND) or dtype (float16/bfloat16/float32
  -> float8 e4m3 with a scale per layer, block and K/V, and back): what engines ask for when
  prefill and decode are configured differently.

Shapes (``L`` layers selected, ``n`` blocks, ``block_nbytes`` = one block of one layer)::

    pack buffer:  [L, n, block_nbytes] bytes, layer-major (layer 0's blocks first)
    scales:       [L, n_float8_side_blocks, 2] float32 (K, V), in the caches' memory

Buffers are numpy arrays (host) or torch tensors (host or CUDA); a device cache needs a
device buffer. Everything is checked first (ConfigError/BlockError naming the value), then
one call moves the bytes with the GIL released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmove import _C
from kvmove.errors import ConfigError
from kvmove.kv_cache import HEAD_ORDERS, KVCache, block_shape
from kvmove.kv_spec import buffer_span

__all__ = ["HEAD_ORDERS", "convert", "pack", "pack_nbytes", "unpack"]


def pack_nbytes(cache: KVCache, num_blocks: int, layers: Sequence[int] | None = None) -> int:
    """Bytes a ``pack`` of ``num_blocks`` blocks of ``layers`` (all when None) takes."""
    num_layers = cache.num_layers if layers is None else len(layers)
    return num_layers * num_blocks * cache.block_nbytes


def pack(cache: KVCache, block_ids: Sequence[int], out: Any,
         layers: Sequence[int] | None = None) -> Any:
    """Copies blocks ``block_ids`` of ``layers`` into ``out`` ([L, n, block_nbytes] bytes at
    its start); returns ``out``."""
    addr, nbytes = buffer_span(out, cache._core.device)
    _C.pack_blocks(cache._core, list(block_ids), list(layers or []), addr, nbytes)
    return out


def unpack(staging: Any, cache: KVCache, block_ids: Sequence[int],
           layers: Sequence[int] | None = None) -> None:
    """The reverse of ``pack``: ``staging``'s blocks into ``block_ids`` of ``cache``."""
    addr, nbytes = buffer_span(staging, cache._core.device)
    _C.unpack_blocks(addr, nbytes, cache._core, list(block_ids), list(layers or []))


def convert(src: KVCache, src_ids: Sequence[int], dst: KVCache, dst_ids: Sequence[int],
            num_tokens: int, *, layers: Sequence[int] | None = None, src_order: str = "NHD",
            dst_order: str = "NHD", scales: Any = None, src_heads: tuple[int, int] | None = None,
            dst_heads: tuple[int, int] | None = None) -> None:
    """Copies tokens ``[0, num_tokens)`` of a sequence held in ``src_ids`` of ``src`` into
    ``dst_ids`` of ``dst``, in each cache's block size and dtype (``cache.layout``) and the
    given head orders. A float8 side needs ``scales`` ([L, n, 2] float32; written for a float8
    destination, read for a float8 source). Positions past ``num_tokens`` in the last
    destination block keep their bytes.

    Tensor parallelism: ``src_heads`` / ``dst_heads`` are ``(first, total)``: a side's
    ``num_kv_heads`` heads are ``[first, first + num_kv_heads)`` of the model's ``total`` (None:
    all). The heads both sides hold move; the destination's others keep their bytes. A float8
    destination must receive all its heads (one scale per block covers them).

    Raises:
        ConfigError: the model's heads or head_dim differ, no head in common, the block lists
            do not cover ``num_tokens`` exactly, a missing or short scales buffer, caches in
            different memories.
        BlockError: a block id out of range.
    """
    for name, order in (("src_order", src_order), ("dst_order", dst_order)):
        if order not in HEAD_ORDERS:
            raise ConfigError(f"{name} must be one of {HEAD_ORDERS}, got {order!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise ConfigError(f"num_tokens must be an int, got {num_tokens!r}")
    addr, nbytes = (0, 0) if scales is None else buffer_span(scales, dst._core.device)
    _C.convert_blocks(src._core, block_shape(src.layout, src_order, src_heads), list(src_ids),
                      dst._core, block_shape(dst.layout, dst_order, dst_heads), list(dst_ids),
                      num_tokens, list(layers or []), addr, nbytes)
