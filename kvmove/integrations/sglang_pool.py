"""SGLang's HiCache host KV pool as a kvmove ``KVCache``, zero-copy: one block per SGLang page.

SGLang keeps the host tier of its hierarchical cache in one ``kv_buffer`` tensor per pool, in
one of several layouts (``--hicache-mem-layout``). ``wrap_host_pool`` describes that tensor to
``KVCache.wrap`` so that a ``KVStore`` copies pages straight out of it and back. Shapes
(L layers, T tokens = P pages of S tokens, H heads of D, MLA latents of width W)::

    MHA layer_first         [2, L, T, H, D]     layer l: K = kv[0, l], V = kv[1, l]: [T, H, D]
                            two planes per layer, a page of S tokens a block
    MHA page_first_direct   [2, P, L, S, H, D]  layer l: kv[0, :, l], kv[1, :, l]: [P, S, H, D]
                            two planes per layer, blocks P apart by L * S * H * D
    MHA page_first          [2, T, L, H, D]     a page's K is one run: [S, L * H, D]
    MHA page_head           [2, P, H, S, L, D]  a page's K is one run of S * H * L * D
    MLA layer_first         [L, T, 1, W]        layer l: kv[l]: [T, W]
    MLA page_first_direct   [P, L, S, 1, W]     layer l: kv[:, l, :, 0]: [P, S, W]
    MLA page_first          [T, L, 1, W]        a page is one run: [S, L * W]

The first two of each kind keep per-layer planes, so their store blocks are kvmove's own
layout of the model (``KVSpec(L, H, D)``): a disk tier written under ``layer_first`` serves a
server started with ``page_first_direct``. In the others a layer's share of a page is not
contiguous (its tokens are L rows apart), and kvmove reads a block as bytes without gathering,
so the whole page is described as one layer: ``KVSpec(1, L * H, D)`` for MHA (``[S, L * W]``
for MLA), whose K bytes are the page's K bytes as SGLang lays them out. Those blocks are in
SGLang's order, so the store's namespace carries the layout name (``layout_tag``): a store
written in one such order is never read in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec

__all__ = ["LAYOUTS", "WrappedPool", "page_ids", "wrap_host_pool"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
           torch.float8_e4m3fn: "float8"}


@dataclass(frozen=True, slots=True)
class WrappedPool:
    """SGLang's host pool as kvmove sees it.

    ``layout_tag``: "layers" where the store's blocks are kvmove's own layout of the model
    (any SGLang layout that keeps per-layer planes), else SGLang's layout name.
    """

    spec: KVSpec
    cache: KVCache
    order: str          # "NHD" or "mla": KVStore(order=)
    layout_tag: str


def wrap_host_pool(pool: Any) -> WrappedPool:
    """Describes an SGLang host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``).

    Read by attribute, not by class: ``layout``, ``page_size``, ``kv_buffer``, ``layer_num``,
    ``dtype``, and ``head_num``, ``head_dim``, ``v_head_dim`` (MHA) or ``kv_cache_dim`` (MLA).

    Raises:
        ConfigError: a layout, dtype or pool kind kvmove cannot describe, naming it.
    """
    kv = getattr(pool, "kv_buffer", None)
    if not isinstance(kv, torch.Tensor):
        raise ConfigError(f"SGLang host pool {type(pool).__name__} has no kv_buffer tensor "
                          "(a logical pool, e.g. DeepSeek V4's): kvmove's backend needs the "
                          "pool that holds the KV bytes")
    if kv.device.type != "cpu":
        raise ConfigError(f"SGLang's host pool is on {kv.device}, expected host memory (cpu)")
    dtype = _DTYPES.get(kv.dtype)
    if dtype is None:
        raise ConfigError(f"SGLang's host pool has dtype {kv.dtype}; kvmove stores "
                          f"{', '.join(str(d) for d in _DTYPES)}")
    page = int(pool.page_size)
    if page < 1 or page & (page - 1):
        raise ConfigError(f"SGLang's page_size must be a power of two for kvmove's store "
                          f"(a page is a block), got {page}")
    if hasattr(pool, "kv_cache_dim"):
        return _wrap_mla(kv, pool.layout, int(pool.layer_num), int(pool.kv_cache_dim), page,
                         dtype)
    if int(pool.v_head_dim) != int(pool.head_dim):
        raise ConfigError(f"SGLang's host pool has K heads of {pool.head_dim} and V heads of "
                          f"{pool.v_head_dim}: kvmove's blocks need K and V of one width")
    return _wrap_mha(kv, pool.layout, int(pool.layer_num), int(pool.head_num),
                     int(pool.head_dim), page, dtype)


def _wrap_mha(kv: torch.Tensor, layout: str, layers: int, heads: int, dim: int, page: int,
              dtype: str) -> WrappedPool:
    _check_layout(layout, LAYOUTS, "MHA")
    spec = KVSpec(layers, heads, dim, dtype, page)
    if layout == "layer_first":
        pairs = [(kv[0, i], kv[1, i]) for i in range(layers)]
        cache = KVCache.wrap(pairs, layout=spec, block_dim=0, page_size=page, pool=None)
        return WrappedPool(spec, cache, "NHD", "layers")
    if layout == "page_first_direct":
        pairs = [(kv[0, :, i], kv[1, :, i]) for i in range(layers)]
        cache = KVCache.wrap(pairs, layout=spec, block_dim=0, pool=None)
        return WrappedPool(spec, cache, "NHD", "layers")
    # page_first [2, T, L, H, D] and page_head [2, P, H, S, L, D]: each page's K (and V) is
    # one contiguous run of S * L * H * D elements, seen as S tokens of L * H heads.
    spec = KVSpec(1, layers * heads, dim, dtype, page)
    tokens = kv.shape[1] * (page if layout == "page_head" else 1)
    k, v = (kv[i].view(tokens, layers * heads, dim) for i in range(2))
    cache = KVCache.wrap([(k, v)], layout=spec, block_dim=0, page_size=page, pool=None)
    return WrappedPool(spec, cache, "NHD", layout)


def _wrap_mla(kv: torch.Tensor, layout: str, layers: int, width: int, page: int,
              dtype: str) -> WrappedPool:
    _check_layout(layout, _MLA_LAYOUTS, "MLA")
    spec = KVSpec(layers, 1, width, dtype, page, mla=True)
    if layout == "layer_first":
        latents = [kv[i].view(kv.shape[1], width) for i in range(layers)]
        cache = KVCache.wrap(latents, layout=spec, block_dim=0, order="mla", page_size=page,
                             pool=None)
        return WrappedPool(spec, cache, "mla", "layers")
    if layout == "page_first_direct":
        latents = [kv[:, i, :, 0] for i in range(layers)]
        cache = KVCache.wrap(latents, layout=spec, block_dim=0, order="mla", pool=None)
        return WrappedPool(spec, cache, "mla", "layers")
    spec = KVSpec(1, 1, layers * width, dtype, page, mla=True)  # page_first [T, L, 1, W]
    cache = KVCache.wrap([kv.view(kv.shape[0], layers * width)], layout=spec, block_dim=0,
                         order="mla", page_size=page, pool=None)
    return WrappedPool(spec, cache, "mla", layout)


def _check_layout(layout: str, known: tuple[str, ...], kind: str) -> None:
    if layout not in known:
        raise ConfigError(f"SGLang's --hicache-mem-layout {layout!r} is not one kvmove's "
                          f"backend describes for an {kind} pool: use one of {known}")


def page_ids(host_indices: torch.Tensor, num_pages: int, page_size: int) -> list[int]:
    """SGLang's host token indices (``num_pages * page_size`` of them, page by page) as
    page ids, the blocks of ``wrap_host_pool``'s cache: page ``p`` is tokens
    ``[p * page_size, (p + 1) * page_size)``.

    Raises:
        ConfigError: a count that is not ``num_pages * page_size``, or a page that does not
            start on a page boundary or whose tokens are not consecutive.
    """
    idx = host_indices.reshape(-1).to("cpu", torch.int64)
    if idx.numel() != num_pages * page_size:
        raise ConfigError(f"got {idx.numel()} host indices for {num_pages} keys, expected "
                          f"{num_pages * page_size} (page_size {page_size} per key)")
    rows = idx.view(num_pages, page_size)
    starts = rows[:, 0]
    misaligned = starts % page_size != 0
    scattered = (rows - starts[:, None] != torch.arange(page_size)).any(dim=1)
    bad = torch.nonzero(misaligned | scattered).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ConfigError(f"host indices of key {i} are not one whole page: "
                          f"{rows[i].tolist()[:8]} (page_size {page_size})")
    return (starts // page_size).tolist()
