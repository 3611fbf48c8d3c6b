"""What ``test_convert.py`` (host memory) and ``test_gpu.py`` (the CUDA kernels) both check
``kvmove.convert`` with: random caches, the conversion cases, and the torch references for
pack, unpack and convert, so both get the same expected bits whichever memory the cache is in.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmove import KVCache, KVSpec
from kvmove.convert import convert

HEADS, DIM, LAYERS, NUM_BLOCKS = 3, 8, 3, 64
FLOAT8_MAX = 448.0
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}


def blocks_view(cache: KVCache, order: str) -> torch.Tensor:
    """[L, N, 2, B, H, D] whatever the head order (HND blocks transposed in the view)."""
    lay = cache.layout
    t = cache.torch()
    if order == "HND":
        t = t.view(lay.num_layers, cache.num_blocks, 2, lay.num_kv_heads, lay.block_size,
                   lay.head_dim).transpose(3, 4)
    return t


def sequence_values(cache: KVCache, ids: list[int], num_tokens: int, order: str,
                    scales: torch.Tensor | None, layers: list[int]) -> torch.Tensor:
    """The sequence's K/V as float32 [len(layers), 2, num_tokens, H, D] (float8 scaled)."""
    lay = cache.layout
    blocks = blocks_view(cache, order)[layers][:, ids].float()  # [L, n, 2, B, H, D]
    if lay.dtype == "float8":
        blocks = blocks * scales.view(len(layers), len(ids), 2, 1, 1, 1)
    x = blocks.permute(0, 2, 1, 3, 4, 5).reshape(len(layers), 2, len(ids) * lay.block_size,
                                                 lay.num_kv_heads, lay.head_dim)
    return x[:, :, :num_tokens]


def expected_convert(src: KVCache, src_ids: list[int], dst: KVCache, dst_ids: list[int],
                     num_tokens: int, src_order: str, dst_order: str,
                     src_scales: torch.Tensor | None, layers: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The destination cache's bytes after the conversion ([L, N, 2, B, H, D] as uint8 bits),
    and the float8 destination's scales [L, n, 2]."""
    values = sequence_values(src, src_ids, num_tokens, src_order, src_scales, layers)
    lay = dst.layout
    out = blocks_view(dst, dst_order).clone()
    scales = (torch.empty(len(layers), len(dst_ids), 2, device=values.device)
              if lay.dtype == "float8" else None)
    for li, layer in enumerate(layers):
        for bi, block in enumerate(dst_ids):
            first = bi * lay.block_size
            count = min(lay.block_size, num_tokens - first)
            for kv in range(2):
                v = values[li, kv, first:first + count]
                if lay.dtype == "float8":
                    amax = v.abs().max()
                    scale = amax / FLOAT8_MAX if amax > 0 else torch.ones_like(amax)
                    scales[li, bi, kv] = scale
                    q = (v / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
                else:
                    q = v.to(TORCH_DTYPES[lay.dtype])
                out[layer, block, kv, :count] = q
    return _bits(out, dst_order), scales


def _bits(view: torch.Tensor, order: str) -> torch.Tensor:
    """The bytes of a [L, N, 2, B, H, D] view as they lie in memory in ``order``, flat."""
    t = view.transpose(3, 4) if order == "HND" else view
    return t.contiguous().view(torch.uint8).flatten()


def cache_bits(cache: KVCache) -> torch.Tensor:
    return cache.torch().view(torch.uint8).flatten()


def expected_pack(cache: KVCache, ids: list[int], layers: list[int]) -> torch.Tensor:
    """[L, n, block_nbytes] bytes: each selected layer's blocks in order."""
    raw = cache.torch().view(torch.uint8).view(cache.num_layers, cache.num_blocks, -1)
    return raw[layers][:, ids].contiguous().flatten()


# --- the cases --------------------------------------------------------------------------------

def layout(dtype: str, block_size: int) -> KVSpec:
    return KVSpec(LAYERS, HEADS, DIM, dtype=dtype, block_size=block_size)


def random_cache(dtype: str, block_size: int, seed: int, device: str | None = None) -> KVCache:
    """Values spread over six orders of magnitude (float8 subnormals after scaling too)."""
    cache = KVCache(layout(dtype, block_size), NUM_BLOCKS, device=device)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(cache.shape, generator=g) * 10.0 ** torch.randint(-4, 2, cache.shape,
                                                                           generator=g)
    if dtype == "float8":
        values = values.clamp(-448, 448)
    cache.torch().copy_(values.to(TORCH_DTYPES[dtype]))
    return cache


def scattered(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).permutation(NUM_BLOCKS)[:n]]


CASES = [  # (src dtype, src block, src order, dst dtype, dst block, dst order)
    ("float16", 16, "NHD", "float16", 64, "NHD"),
    ("float16", 64, "NHD", "float16", 16, "NHD"),
    ("bfloat16", 16, "NHD", "bfloat16", 16, "HND"),
    ("float16", 16, "HND", "float16", 4, "NHD"),
    ("float16", 16, "NHD", "float8", 16, "NHD"),
    ("bfloat16", 16, "NHD", "float8", 64, "HND"),
    ("float32", 4, "NHD", "float8", 16, "NHD"),
    ("float8", 16, "NHD", "float16", 16, "NHD"),
    ("float8", 16, "HND", "bfloat16", 64, "NHD"),
    ("float32", 16, "NHD", "bfloat16", 16, "NHD"),
    ("float16", 16, "NHD", "float32", 8, "HND"),
]


def run_convert(case, num_tokens: int, layers=None, device: str | None = None, seed: int = 0):
    """Converts a random sequence; returns (dst bits, expected bits, scales, expected scales)."""
    sd, sb, so, dd, db, do = case
    src, dst = random_cache(sd, sb, seed, device), random_cache(dd, db, seed + 1, device)
    src_ids = scattered(-(-num_tokens // sb), seed + 2)
    dst_ids = scattered(-(-num_tokens // db), seed + 3)
    selected = layers or list(range(LAYERS))
    dev = src.torch().device
    src_scales = None
    if sd == "float8":
        g = torch.Generator().manual_seed(seed + 4)
        src_scales = (torch.rand(len(selected), len(src_ids), 2, generator=g) + 0.01).to(dev)
    expected, expected_scales = expected_convert(src, src_ids, dst, dst_ids, num_tokens, so, do,
                                                 src_scales, selected)
    scales = src_scales
    if dd == "float8":
        scales = torch.zeros(len(selected), len(dst_ids), 2, device=dev)
    convert(src, src_ids, dst, dst_ids, num_tokens, layers=layers, src_order=so, dst_order=do,
            scales=scales)
    return cache_bits(dst), expected, scales if dd == "float8" else None, expected_scales


def case_id(case) -> str:
    sd, sb, so, dd, db, do = case
    return f"{sd}.{sb}.{so}-{dd}.{db}.{do}"
