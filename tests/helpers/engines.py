"""Each engine's KV tensors as the engine allocates them (small sizes), how kvmove wraps them,
and a torch reference of which element is where: ``kv_of`` reads block ``b`` of layer ``l``
as ``[kv_count, B, H, D]`` (K then V; the MLA latent as ``[1, B, 1, latent]``) straight from
the engine's tensors with torch indexing, never through kvmove's planes.

Engines: "flash" (vLLM flash-attention), "flash-hnd" (the same allocated head-major,
``[2, N, H, B, D]``), "flashinfer" (vLLM FlashInfer), "vllm-cpu" (vLLM's CPU backend),
"sglang" (per-layer K and V token buffers), "mla" (a latent per token), "native" (kvmove's own
KVCache), "native-mla".
"""

from __future__ import annotations

from typing import Any

import torch

import kvmove
from kvmove.bench import engine_caches

ENGINES = ("flash", "flash-hnd", "flashinfer", "vllm-cpu", "sglang", "mla", "native", "native-mla")
MLA_ENGINES = ("mla", "native-mla")


def layout_for(engine: str, num_layers: int = 3, block_size: int = 4,
               dtype: str = "float16") -> kvmove.KVSpec:
    if engine in MLA_ENGINES:
        return kvmove.KVSpec(num_layers, 1, 24, dtype, block_size, mla=True)
    return kvmove.KVSpec(num_layers, 2, 8, dtype, block_size)


def allocate(engine: str, layout: kvmove.KVSpec, num_blocks: int) -> Any:
    """The engine's tensors, zero-filled torch tensors of the layout's dtype in its own shapes
    (the bench's ``engine_caches.allocate``, which ``kvmove-bench transfer --wrap`` uses with
    numpy)."""

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=getattr(torch, layout.dtype))

    return engine_caches.allocate(engine, layout, num_blocks, zeros=zeros)


# The documented wrap call of each engine (docs/engines.md), shared with the bench.
wrap = engine_caches.wrap_engine


def make(engine: str, layout: kvmove.KVSpec, num_blocks: int) -> tuple[Any, kvmove.KVCache]:
    """(tensors, cache): a native cache's tensors are its own torch() view."""
    if engine.startswith("native"):
        cache = kvmove.KVCache(layout, num_blocks)
        return cache.torch(), cache
    tensors = allocate(engine, layout, num_blocks)
    return tensors, wrap(engine, tensors, layout)


def leaves(tensors: Any) -> list[torch.Tensor]:
    """Every tensor, in a fixed order (for filling and snapshots)."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    items = tensors.values() if isinstance(tensors, dict) else tensors
    out: list[torch.Tensor] = []
    for item in items:
        out.extend(item if isinstance(item, tuple) else [item])
    return out


def fill(tensors: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in leaves(tensors):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))


def snapshot(tensors: Any) -> list[torch.Tensor]:
    return [t.clone() for t in leaves(tensors)]


def kv_of(engine: str, leaves_: list[torch.Tensor], layout: kvmove.KVSpec, layer: int,
          block: int) -> torch.Tensor:
    """Block ``block`` of ``layer`` as ``[kv_count, B, H, D]`` (the reference)."""
    b, d = layout.block_size, layout.head_dim
    if engine in ("native", "native-mla"):  # [L, N, kv, B, H, D]
        return leaves_[0][layer, block]
    t = leaves_[layer] if engine != "sglang" else None
    if engine == "flash":  # [2, N, B, H, D]
        return t[:, block]
    if engine == "flash-hnd":  # [2, N, H, B, D]
        return t[:, block].transpose(1, 2)
    if engine == "flashinfer":  # [N, 2, B, H, D]
        return t[block]
    if engine == "vllm-cpu":  # [N, H, B, 2D], viewed [N, H, 2B, D]: a head's K rows, V rows
        blk = t[block].reshape(t.shape[1], 2, b, d)  # [H, 2, B, D], as vLLM's view + chunk
        return blk.permute(1, 2, 0, 3)  # [2, B, H, D]
    if engine == "sglang":  # k_buffer, v_buffer [T, H, D]; page `block` is its B tokens
        k, v = leaves_[2 * layer], leaves_[2 * layer + 1]
        return torch.stack([k[block * b:(block + 1) * b], v[block * b:(block + 1) * b]])
    if engine == "mla":  # [N, B, latent]
        return t[block][None, :, None, :]
    raise ValueError(engine)
