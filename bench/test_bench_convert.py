"""What converting KV between peers that differ costs on the host (docs/engines.md, "Peers that
differ"), against a memcpy of the same blocks in the same run.

Run: ``pytest bench/test_bench_convert.py`` (pytest-benchmark prints each row's mean and, in
parentheses, its ratio to the fastest row of the group). The KV is Llama-3.1-8B's (32 layers x
8 KV heads x 128, float16) for 4,000 tokens, 524 MB; the TP row moves one TP=2 rank's half
(262 MB) into a TP=1 cache.

The baseline is ``kvmove.convert.pack``: the blocks copied as bytes into one buffer, a
memcpy per run of blocks. A conversion of the same dtype copies a head's row at a time; one
that changes the dtype converts element by element.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvmove
from kvmove.convert import convert, pack, pack_nbytes

TOKENS = 4000


def _layout(block_size: int, dtype: str = "float16", heads: int = 8) -> kvmove.KVSpec:
    return kvmove.KVSpec(32, heads, 128, dtype, block_size)


def _cache(layout: kvmove.KVSpec, order: str = "NHD") -> kvmove.KVCache:
    """A cache holding the prompt; a float16 one filled with normal values (as KV is)."""
    cache = kvmove.KVCache(layout, layout.blocks_for(TOKENS), order=order)
    if layout.dtype == "float16":
        view = cache.numpy()
        view[...] = np.random.default_rng(0).standard_normal(view.shape, np.float32)
    return cache


def test_baseline_pack_memcpy(benchmark) -> None:
    src = _cache(_layout(16))
    ids = list(range(src.num_blocks))
    out = np.empty(pack_nbytes(src, len(ids)), np.uint8)
    benchmark(pack, src, ids, out)


CASES = {
    "block 16 -> 64": (_layout(16), _layout(64), "NHD", "NHD", None),
    "NHD -> HND": (_layout(16), _layout(16), "NHD", "HND", None),
    "float16 -> bfloat16": (_layout(16), _layout(16, "bfloat16"), "NHD", "NHD", None),
    "TP=2 rank -> TP=1": (_layout(16, heads=4), _layout(16), "NHD", "NHD", (4, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_convert(benchmark, case: str) -> None:
    src_layout, dst_layout, src_order, dst_order, src_heads = CASES[case]
    src, dst = _cache(src_layout, src_order), _cache(dst_layout, dst_order)
    src_ids, dst_ids = list(range(src.num_blocks)), list(range(dst.num_blocks))
    benchmark(convert, src, src_ids, dst, dst_ids, TOKENS, src_order=src_order,
              dst_order=dst_order, src_heads=src_heads)
