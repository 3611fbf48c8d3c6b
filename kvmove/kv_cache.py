"""KVCache: paged KV memory for one model, as blocks of a BlockPool.

Memory order, layer-major (``L`` layers, ``N`` blocks, ``B`` = block_size tokens, ``H`` KV
heads, ``D`` = head_dim)::

    [L, N, 2, B, H, D]

    region  | layer 0                         | layer 1                         | ...
            | block 0 | block 1 | ... | N-1   | block 0 | block 1 | ... | N-1   |
    block   | K [B, H, D]  | V [B, H, D]  |

    offset(layer, block) = (layer * N + block) * layout.bytes_per_block_per_layer

Why this order: one layer of a run of consecutive blocks is one contiguous byte range, so
layer-wise streaming posts one operation per run per layer, and a full transfer of a run is
``L`` operations however long the run. Keeping K and V of a block together (rather than
``[L, 2, N, ...]``) halves that count again; per layer it is FlashInfer's paged layout
``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD), which attention kernels read
directly. The alternative that makes a block contiguous across layers (``[N, L, ...]``) would
force a strided send per layer while streaming.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmove import _C
from kvmove.block_pool import BlockPool
from kvmove.errors import AllocationError, ConfigError
from kvmove.kv_spec import KVSpec
from kvmove.region import Region
from kvmove.wrap import ORDERS, planes_of

if TYPE_CHECKING:
    import torch

__all__ = ["KVCache", "block_shape", "check_kv_heads"]

# numpy has no bfloat16 or float8: those views carry the raw bits (torch() has the real type).
_NUMPY_DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8": np.uint8,
}
_TORCH_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8": "float8_e4m3fn",
}
# The orders whose blocks hold K and V of several heads: convertible into each other
# (kvmove.convert) and allocatable (a staging area in a vLLM CPU sender's order).
HEAD_ORDERS = ("NHD", "HND", "vllm-cpu")


def block_shape(layout: KVSpec, order: str = "NHD",
                kv_heads: tuple[int, int] | None = None) -> _C.BlockShape:
    """What one block of one layer of ``layout`` holds, as the core sees it (``order``: NHD
    token-major, HND head-major, ``vllm-cpu``, ``mla``; kvmove.wrap draws them).

    ``kv_heads``: ``(first, total)`` for a tensor-parallel rank whose ``layout.num_kv_heads``
    heads are ``[first, first + num_kv_heads)`` of the model's ``total``; None: all of them.
    """
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {ORDERS}, got {order!r}")
    first, total = check_kv_heads(layout, kv_heads)
    parsed = _C.parse_order(order)
    assert parsed is not None  # one of ORDERS, each of which the core knows
    return _C.BlockShape(layout.block_size, layout.num_kv_heads, layout.head_dim,
                         getattr(_C.DType, layout.dtype), parsed, first, total)


def check_kv_heads(layout: KVSpec, kv_heads: tuple[int, int] | None) -> tuple[int, int]:
    """``(first, total)``, checked against ``layout``: a head range of the model's heads."""
    if kv_heads is None:
        return 0, layout.num_kv_heads
    if (not isinstance(kv_heads, tuple) or len(kv_heads) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in kv_heads)):
        raise ConfigError(f"kv_heads must be (first, total), two ints, got {kv_heads!r}")
    first, total = kv_heads
    if first < 0 or first + layout.num_kv_heads > total:
        raise ConfigError(f"kv_heads {kv_heads}: heads [{first}, "
                          f"{first + layout.num_kv_heads}) (num_kv_heads "
                          f"{layout.num_kv_heads}) must lie in [0, {total}) of the model")
    return first, total


class KVCache:
    """Host or device memory for ``num_blocks`` paged KV blocks of ``layout``, with their
    BlockPool.

    An engine that owns its KV tensors wraps them instead: ``KVCache.wrap`` (docs/engines.md).

    Example:
        >>> layout = kvmove.KVSpec.preset("llama-3.1-8b")
        >>> cache = kvmove.KVCache(layout, num_blocks=1024)
        >>> ids = cache.pool.allocate(layout.blocks_for(4000))
        >>> cache.descriptors(ids, layers=[0])     # [(addr, nbytes)], coalesced

    Args:
        layout: the model's KV shape.
        num_blocks: blocks in the pool (the region holds ``num_blocks * layout.bytes_per_block``
            bytes, zero-filled).
        huge_pages: align to 2 MiB and ask for transparent huge pages (host memory).
        device: None or ``"cpu"`` for host memory; ``"cuda"``, ``"cuda:N"`` or ``N`` for one
            cudaMalloc on that device (needs a CUDA build, ``kvmove.cuda_status()``). An
            ``Agent`` registers device memory with UCX as CUDA memory (cuda_ipc, GPUDirect
            RDMA).
        pin: page-lock host memory for DMA to and from GPUs (cudaHostRegister); nothing where
            no CUDA device is usable. None: pin when one is (what storage tiers and staging
            buffers use). Off by default: pinning creates a CUDA context in the process.
        order: the element order inside a block, ``"NHD"`` (the default, drawn above) or
            ``"HND"`` (``[2, H, B, D]`` per block): a staging cache in a peer's order
            (kvmove.staging). An MLA layout's is ``"mla"``.

    Attributes:
        pool: the ``BlockPool`` handing out this cache's block ids (None for a cache wrapped
            with ``pool=None``: the engine allocates).
        region: the ``Region`` holding the bytes (None for a wrapped cache).
        order: the element order inside a block: "NHD" (or "mla" for an MLA layout) for a
            cache kvmove allocates; a wrapped cache's ``order``.
        tensors: a wrapped cache's tensors (held so they outlive it), else None.
        layer_names: a wrapped cache's layer names (the dict's keys), else None.
    """

    def __init__(self, layout: KVSpec, num_blocks: int, *, huge_pages: bool = False,
                 device: str | int | None = None, pin: bool | None = False,
                 order: str | None = None) -> None:
        index = _device_index(device)
        order = _allocated_order(layout, order)
        gpus = _C.cuda_status()[1] > 0
        if pin is None:
            pin = index < 0 and gpus
        self._core = _C.KVCache(layout.num_layers, num_blocks, layout.bytes_per_block_per_layer,
                                huge_pages, index, bool(pin))
        self.layout = layout
        self.order = order
        self.pool: BlockPool | None = BlockPool._of(self._core.pool, self)
        self.region: Region | None = Region._of(self._core.region, self)
        self.tensors: list[Any] | None = None
        self.layer_names: list[str] | None = None
        if pin and gpus and not self.region.pinned:
            raise AllocationError(f"cannot pin {self.region.nbytes} bytes of host memory "
                                  "(cudaHostRegister refused; see ulimit -l)")

    @classmethod
    def wrap(cls, tensors: Sequence[Any] | Mapping[str, Any], *, layout: KVSpec,
             block_dim: int, kv_dim: int | None = None, order: str = "NHD",
             pool: bool | None = True, page_size: int | None = None) -> KVCache:
        """A cache over an engine's own KV tensors, zero-copy: the engine keeps them and
        kvmove never frees them (it holds a reference to each).

        Every tensor is registered once with the transport; transfers and layer streams then
        work as on a cache kvmove allocated, one operation per run of consecutive blocks per
        plane. docs/engines.md has each engine's call.

        Example:
            >>> layout = kvmove.KVSpec(num_layers=2, num_kv_heads=8, head_dim=128)
            >>> kv = {f"layers.{i}.attn": torch.zeros(2, 64, 16, 8, 128, dtype=torch.float16)
            ...       for i in range(2)}              # vLLM flash: [2, N, B, H, D] per layer
            >>> cache = kvmove.KVCache.wrap(kv, layout=layout, block_dim=1, kv_dim=0, pool=None)
            >>> cache.num_blocks, cache.num_parts    # K and V apart: two planes per layer
            (64, 2)

        Args:
            tensors: per layer, in layer order: a list, or a dict of layer name -> tensor
                (vLLM's ``register_kv_caches`` argument as is). A layer is one tensor, or a
                ``(K, V)`` pair of tensors (SGLang's ``k_buffer[l], v_buffer[l]``). torch
                tensors (CPU, or CUDA in a CUDA build) or numpy arrays, all on one device.
            layout: the model's KV shape; its dtype must be the tensors'.
            block_dim: the dimension indexing blocks (tokens, with ``page_size``).
            kv_dim: the dimension of size 2 that splits K and V, if any. Before ``block_dim``
                the layer has two planes (K, V); right after it, K and V of a block are side
                by side and the layer has one.
            order: the element order inside a block: "NHD" ``[B, H, D]`` per K/V, "HND"
                ``[H, B, D]``, "vllm-cpu" ``[H, B, 2 * D]`` (vLLM's CPU attention reads it as
                ``[H, 2 * B, D]``: a head's K rows, then its V rows), "mla" ``[B, latent]``
                (an MLA layout). An NHD or HND view of an allocation in the other order (its
                strides say so; vLLM's FlashInfer HND) is wrapped as its memory holds it: the
                cache's ``order`` is then the other.
            pool: True: a ``BlockPool`` of its own, as a cache kvmove allocates; None: the
                engine allocates blocks, and transfers take its block ids.
            page_size: ``block_dim`` counts tokens, grouped into pages (blocks) of this many;
                must equal ``layout.block_size`` (SGLang's paged buffers).

        Raises:
            ConfigError: a tensor whose shape, strides, dtype or device does not fit, naming
                the tensor, the dimension and what was expected; or the wrong layer count.
        """
        found = planes_of(tensors, layout, block_dim, kv_dim, order, page_size)
        cache = cls.__new__(cls)
        cache._core = _C.KVCache(layout.num_layers, found.num_blocks, found.num_parts,
                                found.planes, found.segments, found.device)
        cache.layout, cache.order, cache.region = layout, found.order, None
        cache.pool = BlockPool._of(cache._core.pool, cache) if pool else None
        entries = tensors.values() if isinstance(tensors, Mapping) else tensors
        cache.tensors = list(entries)  # the engine's memory stays alive while we are
        cache.layer_names = found.names if isinstance(tensors, Mapping) else None
        return cache

    @property
    def wrapped(self) -> bool:
        """Built by ``wrap`` over an engine's tensors (it then has no ``region``).

        Example:
            >>> kvmove.KVCache(layout, num_blocks=8).wrapped
            False
        """
        return bool(self._core.wrapped)

    @property
    def num_parts(self) -> int:
        """Planes per layer: 1 (K and V of a block together), or 2 (apart).

        Example:
            >>> kvmove.KVCache(layout, num_blocks=8).num_parts    # [L, N, 2, B, H, D]
            1
        """
        return self._core.num_parts

    @property
    def num_layers(self) -> int:
        return self._core.num_layers

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block in one layer (K and V)."""
        return self._core.block_nbytes

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) from the region's start."""
        return self._core.offset(layer, block)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        index = self._core.device
        return "cpu" if index < 0 else f"cuda:{index}"

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(L, N, 2, B, H, D)``, the memory order above (``(L, N, 2, H, B, D)`` for an HND
        cache)."""
        lay = self.layout
        if self.wrapped:
            raise ConfigError("a wrapped cache is laid out by its engine: see its tensors")
        inner = (lay.block_size, lay.num_kv_heads)
        if self.order == "HND":
            inner = inner[::-1]
        return (lay.num_layers, self.num_blocks, lay.kv_count, *inner, lay.head_dim)

    def numpy(self) -> np.ndarray:
        """Zero-copy writable view ``[L, N, 2, B, H, D]``; bfloat16 and float8 as raw bits
        (uint16, uint8). Host memory only (a device cache: ``torch()``)."""
        shape = self.shape
        if self.region is None or self.region.device >= 0:
            raise ConfigError(f"a KVCache on {self.device} has no numpy view: use torch()")
        raw = np.asarray(self.region)
        return raw.view(_NUMPY_DTYPES[self.layout.dtype]).reshape(shape)

    def torch(self) -> torch.Tensor:
        """Zero-copy tensor view ``[L, N, 2, B, H, D]`` in the layout's dtype, on the cache's
        device (needs torch)."""
        import torch

        shape = self.shape
        assert self.region is not None  # shape raised for a wrapped cache
        if self.region.device >= 0:
            raw = torch.as_tensor(self, device=self.device)  # __cuda_array_interface__
        else:
            raw = torch.from_dlpack(np.asarray(self.region))
        return raw.view(getattr(torch, _TORCH_DTYPES[self.layout.dtype])).view(shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """A device cache's bytes (``[nbytes]`` uint8, CUDA Array Interface v3) for torch,
        CuPy or Numba; no stream to wait on (kvmove's device calls return synchronized).
        AttributeError for a host cache, as the interface expects."""
        if self.region is None or self.region.device < 0:
            raise AttributeError("a host or wrapped KVCache has no __cuda_array_interface__")
        return self.region.__cuda_array_interface__

    def descriptors(
        self, block_ids: list[int], layers: list[int] | None = None
    ) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` ranges holding ``block_ids`` in ``layers`` (all when None).

        Layer order first, then block order; consecutive ids form one range per layer, and
        ranges that touch (e.g. all blocks of adjacent layers) merge into one.

        Raises:
            BlockError: a block id out of range.
            ConfigError: a layer out of range.
        """
        return self._core.descriptors(block_ids, layers)

    def __repr__(self) -> str:
        if self.region is None:
            return (f"KVCache.wrap({self.layout!r}, num_blocks={self.num_blocks}, "
                    f"order={self.order!r}, parts={self.num_parts}, device={self.device!r})")
        assert self.pool is not None
        return (f"KVCache({self.layout!r}, num_blocks={self.num_blocks}, "
                f"nbytes={self.region.nbytes}, device={self.device!r}, "
                f"free={self.pool.num_free})")


def _allocated_order(layout: KVSpec, order: str | None) -> str:
    """The order of a cache kvmove allocates: one of HEAD_ORDERS, or mla for an MLA layout."""
    if layout.mla:
        if order not in (None, "mla"):
            raise ConfigError(f"an MLA layout's blocks are in order 'mla', got {order!r}")
        return "mla"
    if order is None:
        return "NHD"
    if order not in HEAD_ORDERS:
        raise ConfigError(f"order of an allocated cache must be one of {HEAD_ORDERS}, got "
                          f"{order!r} (wrap an engine's tensors for the others)")
    return order


def _device_index(device: str | int | None) -> int:
    """-1 for host memory, else the CUDA device index."""
    if device is None or device == "cpu":
        return -1
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        index = device.partition(":")[2] or "0"
        if index.isdigit():
            return int(index)
    raise ConfigError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or N >= 0, got {device!r}")
