"""An engine's KV tensors as planes: what ``kvmove.KVCache.wrap`` reads from them.

A plane is one part of every block of one layer, at a fixed stride (csrc/common/kv_geometry.h):
``block b at base + b * block_stride``, the block's bytes contiguous. Each engine tensor is one
segment (registered once with UCX) holding one or two planes:

    vLLM flash-attention, kv_dim=0, block_dim=1   [2, N, B, H, D]   two planes: K, V
        tensor | K: block 0 | block 1 | ... | V: block 0 | block 1 | ...
    vLLM FlashInfer, block_dim=0, kv_dim=1        [N, 2, B, H, D]   one plane, K and V inside
        tensor | block 0: K V | block 1: K V | ...
    vLLM CPU, block_dim=0, order="vllm-cpu"       [N, H, B, 2D]     one plane
    SGLang, (k, v) pairs, block_dim=0, page_size  [T, H, D] x 2     two planes, a page a block
    MLA, block_dim=0, order="mla"                 [N, B, latent]    one plane

The dims after the block dim must be the order's block shape, C-contiguous: kvmove reads a
block as bytes and never gathers it. One permuted view is recognised: an NHD or HND block whose
strides show the other order in memory (vLLM hands FlashInfer's HND allocation over as an NHD
view) is wrapped in its memory order, which the cache's ``order`` then says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvmove import _C
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["ORDERS", "WrappedPlanes", "planes_of"]

ORDERS = ("NHD", "HND", "vllm-cpu", "mla")
_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "float8_e4m3fn": "float8"}
_NUMPY_DTYPES = {"float32": "float32", "float16": "float16"}


@dataclass(frozen=True, slots=True)
class _Array:
    """One tensor as seen here: strides in bytes, device -1 for host memory."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    addr: int
    itemsize: int
    dtype: str
    device: int


@dataclass(frozen=True, slots=True)
class WrappedPlanes:
    """What ``planes_of`` found: the core's arguments, and the layer names in order."""

    names: list[str]
    num_blocks: int
    num_parts: int
    planes: list[tuple[int, int, int, int]]  # (base, block_stride, block_nbytes, segment)
    segments: list[tuple[int, int]]  # (addr, nbytes), one per tensor
    device: int
    order: str  # the blocks' order in memory: ``order``, or NHD and HND swapped for a view


def planes_of(tensors: Sequence[Any] | Mapping[str, Any], layout: KVSpec, block_dim: int,
              kv_dim: int | None, order: str, page_size: int | None) -> WrappedPlanes:
    """The planes and segments of an engine's tensors (``KVCache.wrap`` documents the args).

    Raises:
        ConfigError: naming the tensor, the dimension and what was expected.
    """
    _check_order(layout, order, kv_dim, page_size)
    names, entries = _entries(tensors)
    if len(entries) != layout.num_layers:
        raise ConfigError(f"got {len(entries)} layers of tensors, the layout has "
                          f"{layout.num_layers} (num_layers)")
    _check_same("devices", {part_name: _device_label(obj) for name, entry in zip(names, entries)
                            for part_name, obj in _split(name, entry, kv_dim)}, str)
    planes: list[tuple[int, int, int, int]] = []
    segments: list[tuple[int, int]] = []
    blocks: dict[str, int] = {}
    device = -1
    parts_of: dict[str, int] = {}
    orders: dict[str, str] = {}
    for name, entry in zip(names, entries):
        parts, before = _split(name, entry, kv_dim), len(planes)
        for part_name, obj in parts:
            array = _describe(obj, part_name)
            _check_dtype(array, layout)
            device = array.device
            segment = len(segments)
            segments.append((array.addr, _span(array)))
            found, orders[array.name] = _tensor_planes(array, layout, block_dim, kv_dim, order,
                                                       page_size)
            for base, stride, nbytes, num in found:
                blocks[array.name] = num
                planes.append((base, stride, nbytes, segment))
        parts_of[name] = len(planes) - before
    _check_same("parts per layer (K and V together or apart)", parts_of, str)
    _check_same("numbers of blocks", blocks, str)
    _check_same("the order of a block in memory", orders, str)
    return WrappedPlanes(names, next(iter(blocks.values())), parts_of[names[0]], planes, segments,
                         device, next(iter(orders.values())))


def _check_order(layout: KVSpec, order: str, kv_dim: int | None,
                 page_size: int | None) -> None:
    if order not in ORDERS:
        raise ConfigError(f"order must be one of {ORDERS}, got {order!r}")
    if (order == "mla") != layout.mla:
        raise ConfigError(f"order {order!r} needs a layout with mla={order == 'mla'}, got "
                          f"mla={layout.mla}")
    if order in ("vllm-cpu", "mla") and kv_dim is not None:
        raise ConfigError(f"order {order!r} has no separate K/V dimension: kv_dim must be None, "
                          f"got {kv_dim}")
    if page_size is not None and page_size != layout.block_size:
        raise ConfigError(f"page_size {page_size} must equal the layout's block_size "
                          f"{layout.block_size} (a page is a block)")
    if page_size is not None and order not in ("NHD", "mla"):
        raise ConfigError(f"pages of tokens hold token-major blocks: order must be NHD or mla "
                          f"with page_size, got {order!r}")


def _entries(tensors: Sequence[Any] | Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    if isinstance(tensors, Mapping):
        return [str(k) for k in tensors], list(tensors.values())
    if isinstance(tensors, (list, tuple)):
        return [f"tensors[{i}]" for i in range(len(tensors))], list(tensors)
    raise ConfigError(f"tensors must be a list (layer order) or a dict of layer name -> "
                      f"tensor, got {type(tensors).__name__}")


def _split(name: str, entry: Any, kv_dim: int | None) -> list[tuple[str, Any]]:
    """A layer's tensors: one, or a (K, V) pair (SGLang's k_buffer[l], v_buffer[l])."""
    if not isinstance(entry, (list, tuple)):
        return [(name if name.startswith("tensors[") else repr(name), entry)]
    label = name if name.startswith("tensors[") else repr(name)
    if len(entry) != 2:
        raise ConfigError(f"{label}: a layer is one tensor or a (K, V) pair, got "
                          f"{len(entry)} tensors")
    if kv_dim is not None:
        raise ConfigError(f"{label}: K and V come as two tensors, kv_dim must be None, "
                          f"got {kv_dim}")
    return [(f"{label} K", entry[0]), (f"{label} V", entry[1])]


def _device_label(obj: Any) -> str:
    """Where a tensor lives ("cpu", "cuda:0", ...), before anything else is read from it."""
    device = getattr(obj, "device", None)
    if device is not None and hasattr(obj, "data_ptr"):
        return f"{device.type}:{device.index or 0}" if device.type == "cuda" else device.type
    return "cpu"


def _describe(obj: Any, name: str) -> _Array:
    if hasattr(obj, "data_ptr") and hasattr(obj, "stride"):  # a torch tensor
        dtype = _TORCH_DTYPES.get(str(obj.dtype).removeprefix("torch."), str(obj.dtype))
        device = -1 if obj.device.type == "cpu" else _cuda_index(obj, name)
        size = obj.element_size()
        return _Array(name, tuple(obj.shape), tuple(s * size for s in obj.stride()),
                      int(obj.data_ptr()), size, dtype, device)
    if not isinstance(obj, np.ndarray):
        raise ConfigError(f"tensor {name} must be a torch tensor or a numpy array, got "
                          f"{type(obj).__name__}")
    if not obj.flags.writeable:
        raise ConfigError(f"tensor {name} is read-only: a transfer writes into it")
    dtype = _NUMPY_DTYPES.get(obj.dtype.name, obj.dtype.name)
    return _Array(name, obj.shape, obj.strides, int(obj.ctypes.data), obj.itemsize, dtype, -1)


def _cuda_index(tensor: Any, name: str) -> int:
    if tensor.device.type != "cuda":
        raise ConfigError(f"tensor {name} is on {tensor.device}: kvmove wraps host (cpu) and "
                          "CUDA memory")
    if not _C.cuda_status()[0]:
        raise ConfigError(f"tensor {name} is on {tensor.device}, and this kvmove is built "
                          "without CUDA (rebuild with KVMOVE_CUDA=1)")
    return tensor.device.index or 0


def _check_dtype(array: _Array, layout: KVSpec) -> None:
    if array.dtype != layout.dtype:
        raise ConfigError(f"tensor {array.name} has dtype {array.dtype}, the layout's is "
                          f"{layout.dtype}")


def _span(array: _Array) -> int:
    """Bytes from the first element to the end of the last (strides checked non-negative
    later, per plane; a negative one is refused here)."""
    if any(s < 0 for s in array.strides) or 0 in array.shape:
        raise ConfigError(f"tensor {array.name} of shape {array.shape} with strides "
                          f"{array.strides} B is empty or has a negative stride")
    return sum((n - 1) * s for n, s in zip(array.shape, array.strides)) + array.itemsize


def _block_dims(layout: KVSpec, order: str) -> list[tuple[str, int]]:
    """(name, size) of the dims of one block of one part, outermost first."""
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    return {
        "NHD": [("block_size", b), ("num_kv_heads", h), ("head_dim", d)],
        "HND": [("num_kv_heads", h), ("block_size", b), ("head_dim", d)],
        "vllm-cpu": [("num_kv_heads", h), ("block_size", b), ("2 * head_dim", 2 * d)],
        "mla": [("block_size", b), ("latent width (head_dim)", d)],
    }[order]


def _tensor_planes(array: _Array, layout: KVSpec, block_dim: int, kv_dim: int | None,
                   order: str, page_size: int | None
                   ) -> tuple[list[tuple[int, int, int, int]], str]:
    """(base, block_stride, block_nbytes, num_blocks) of each plane in one tensor, and the
    order of its blocks in memory."""
    ndim = len(array.shape)
    for what, dim in (("block_dim", block_dim), ("kv_dim", kv_dim)):
        if dim is not None and not 0 <= dim < ndim:
            raise ConfigError(f"tensor {array.name} has {ndim} dims {array.shape}, {what} "
                              f"{dim} is not one of them")
    dims = [i for i in range(ndim) if i != kv_dim or kv_dim > block_dim]
    if page_size is None and order in _SWAPPED and len(dims) >= 4 and \
            block_dim not in dims[-3:] and kv_dim not in dims[-3:]:
        array, order = _in_memory_order(array, dims[-3], dims[-2], order)
    inner = _block_dims(layout, order)
    bases = [array.addr]
    if kv_dim is not None:
        if kv_dim == block_dim:
            raise ConfigError(f"kv_dim and block_dim must differ, both are {kv_dim}")
        if array.shape[kv_dim] != 2:
            raise ConfigError(f"tensor {array.name} dim {kv_dim} (kv_dim) is "
                              f"{array.shape[kv_dim]}, expected 2 (K and V)")
        if kv_dim < block_dim:  # K and V apart: two planes
            bases = [array.addr, array.addr + array.strides[kv_dim]]
        elif kv_dim == block_dim + 1:  # K and V of a block side by side: one plane
            inner = [("K/V", 2)] + inner
        else:
            raise ConfigError(f"tensor {array.name}: kv_dim {kv_dim} is inside the block but "
                              f"not right after block_dim {block_dim}, so a block is not "
                              f"K then V")
    if page_size is not None:
        inner = inner[1:]  # the block dim counts tokens; a block is page_size of them
    if dims[0] != block_dim:
        raise ConfigError(f"tensor {array.name}: dims {dims[:dims.index(block_dim)]} come "
                          f"before block_dim {block_dim}; the block dim must be outermost "
                          f"(after kv_dim)")
    _check_inner(array, dims[1:], inner)
    nbytes = array.itemsize * int(np.prod([size for _, size in inner]))
    stride, num = array.strides[block_dim], array.shape[block_dim]
    if page_size is not None:
        stride, num = _pages(array, block_dim, nbytes, page_size)
        nbytes *= page_size
    if stride < nbytes:
        raise ConfigError(f"tensor {array.name} dim {block_dim} (blocks) has a stride of "
                          f"{stride} B, expected at least the block's {nbytes} B")
    return [(base, stride, nbytes, num) for base in bases], order


_SWAPPED = {"NHD": "HND", "HND": "NHD"}


def _in_memory_order(array: _Array, outer: int, inner: int, order: str) -> tuple[_Array, str]:
    """``array`` and ``order`` as its memory holds them: when the block's two leading dims
    (tokens and heads, NHD or HND) are stored the other way round (a permuted view, such as
    vLLM's of FlashInfer's HND allocation), the view with those two swapped, in the other
    order; else both unchanged. Whether the result is contiguous is checked after."""
    if min(array.shape[outer], array.shape[inner]) < 2 or \
            array.strides[outer] >= array.strides[inner]:
        return array, order
    shape, strides = list(array.shape), list(array.strides)
    for swap in (shape, strides):
        swap[outer], swap[inner] = swap[inner], swap[outer]
    return replace(array, shape=tuple(shape), strides=tuple(strides)), _SWAPPED[order]


def _check_inner(array: _Array, dims: list[int], inner: list[tuple[str, int]]) -> None:
    """The dims inside a block: the order's sizes, C-contiguous."""
    if len(dims) != len(inner):
        raise ConfigError(f"tensor {array.name} has {len(array.shape)} dims {array.shape}: "
                          f"a block needs {len(inner)} dims after the block dim "
                          f"({', '.join(n for n, _ in inner)})")
    step = array.itemsize
    for dim, (what, size) in reversed(list(zip(dims, inner))):
        if array.shape[dim] != size:
            raise ConfigError(f"tensor {array.name} dim {dim} is {array.shape[dim]}, expected "
                              f"{what} = {size} (shape {array.shape})")
        if array.strides[dim] != step and size > 1:
            raise ConfigError(f"tensor {array.name} is not contiguous inside a block: dim {dim} "
                              f"({what}) has a stride of {array.strides[dim]} B, expected "
                              f"{step} B (strides {array.strides} B)")
        step *= size


def _pages(array: _Array, token_dim: int, token_nbytes: int, page_size: int) -> tuple[int, int]:
    """(block_stride, num_blocks) of a tensor whose token_dim holds pages of page_size tokens."""
    tokens, stride = array.shape[token_dim], array.strides[token_dim]
    if stride != token_nbytes:
        raise ConfigError(f"tensor {array.name} dim {token_dim} (tokens) has a stride of "
                          f"{stride} B, expected {token_nbytes} B: a page's tokens must be "
                          "contiguous")
    if tokens % page_size:
        raise ConfigError(f"tensor {array.name} dim {token_dim} holds {tokens} tokens, expected "
                          f"a multiple of page_size {page_size}")
    return stride * page_size, tokens // page_size


def _check_same(what: str, values: dict[str, Any], show: Any) -> None:
    first_name, first = next(iter(values.items()))
    for name, value in values.items():
        if value != first:
            raise ConfigError(f"the tensors must agree on {what}: tensor {name} has "
                              f"{show(value)}, tensor {first_name} has {show(first)}")

