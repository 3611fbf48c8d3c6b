"""``kvmove.convert`` on host memory against the torch references of ``helpers/convert.py``:
pack/unpack of scattered blocks and layer subsets, and conversions of block size, head order
and dtype (float8 e4m3 with per-block scales), bit for bit, on odd block counts and lengths.
The CUDA kernels are checked against the same references in ``test_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmove import KVCache, KVSpec
from kvmove.convert import convert, pack, pack_nbytes, unpack
from kvmove.errors import BlockError, ConfigError

from helpers.convert import (
    CASES,
    DIM,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    case_id,
    expected_pack,
    layout,
    random_cache,
    run_convert,
    scattered,
)

# --- pack / unpack -----------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [None, [1], [2, 0]])
@pytest.mark.parametrize("ids", [[5], [3, 4, 5, 6], [9, 2, 30, 31, 7]])
def test_pack_is_the_blocks_layer_by_layer(ids, layers):
    cache = random_cache("float16", 16, 0)
    out = np.zeros(pack_nbytes(cache, len(ids), layers), np.uint8)
    pack(cache, ids, out, layers)
    expected = expected_pack(cache, ids, layers or list(range(LAYERS)))
    assert np.array_equal(out, expected.numpy())


def test_unpack_restores_packed_blocks_elsewhere():
    src, dst = random_cache("bfloat16", 16, 1), KVCache(layout("bfloat16", 16), NUM_BLOCKS)
    src_ids, dst_ids = scattered(13, 2), scattered(13, 3)
    staging = torch.zeros(pack_nbytes(src, 13), dtype=torch.uint8)
    pack(src, src_ids, staging)
    unpack(staging, dst, dst_ids)
    assert torch.equal(dst.torch()[:, dst_ids], src.torch()[:, src_ids])
    others = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
    assert not dst.torch()[:, others].view(torch.int16).any()  # nothing else written


def test_pack_into_a_short_buffer_is_refused_naming_both_sizes():
    cache = random_cache("float16", 16, 0)
    need = pack_nbytes(cache, 3)
    with pytest.raises(ConfigError, match=f"{need - 1} B.*need {need}"):
        pack(cache, [0, 1, 2], np.zeros(need - 1, np.uint8))


@pytest.mark.parametrize(("ids", "layers", "error"), [
    ([NUM_BLOCKS], None, BlockError), ([-1], None, BlockError), ([0], [LAYERS], ConfigError),
])
def test_pack_rejects_bad_ids_and_layers(ids, layers, error):
    cache = random_cache("float16", 16, 0)
    with pytest.raises(error):
        pack(cache, ids, np.zeros(1 << 16, np.uint8), layers)


def test_pack_needs_a_contiguous_writable_buffer():
    cache = random_cache("float16", 16, 0)
    with pytest.raises(ConfigError, match="contiguous"):
        pack(cache, [0], np.zeros((2, 1 << 14), np.uint8)[:, ::2])


# --- convert -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 37, 128, 201])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_convert_matches_the_torch_reference_bit_for_bit(case, num_tokens):
    got, expected, scales, expected_scales = run_convert(case, num_tokens)
    assert torch.equal(got, expected)
    if expected_scales is not None:
        assert torch.equal(scales, expected_scales)


def test_convert_a_subset_of_layers_leaves_the_others():
    case = ("float16", 16, "NHD", "float16", 64, "HND")
    got, expected, _, _ = run_convert(case, 100, layers=[2, 0])
    assert torch.equal(got, expected)


def test_float8_round_trip_is_within_half_a_step():
    """float16 -> float8 -> float16: each value within half a float8 step of its block's scale
    (3 mantissa bits: relative 1/16, or the subnormal step 2^-9 times the scale)."""
    src = random_cache("float16", 16, 5)
    mid = KVCache(layout("float8", 16), NUM_BLOCKS)
    back = KVCache(layout("float16", 16), NUM_BLOCKS)
    ids = list(range(7))
    scales = torch.zeros(LAYERS, 7, 2)
    convert(src, ids, mid, ids, 100, scales=scales)
    convert(mid, ids, back, ids, 100, scales=scales)
    a = src.torch()[:, ids].float().view(LAYERS, 7, 2, 16, HEADS * DIM)
    b = back.torch()[:, ids].float().view(LAYERS, 7, 2, 16, HEADS * DIM)
    step = scales.view(LAYERS, 7, 2, 1, 1) * 2.0 ** -9  # the subnormal step, scaled
    tolerance = torch.maximum(a.abs() / 16, step) + a.abs() * 2.0 ** -10  # + float16 rounding
    converted = (torch.arange(7 * 16) < 100).view(1, 7, 1, 16, 1).expand_as(a)
    assert ((a - b).abs() <= tolerance)[converted].all()
    assert torch.equal(b[~converted], torch.zeros_like(b[~converted]))  # never written


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_tokens": 0}, "num_tokens must be positive"),
    ({"num_tokens": 33}, "33 tokens take 3 source"),
    ({"src_order": "NDH"}, "src_order"),
])
def test_convert_rejects_bad_arguments(kwargs, match):
    src, dst = random_cache("float16", 16, 0), random_cache("float16", 16, 1)
    args = {"num_tokens": 32, **kwargs}
    with pytest.raises(ConfigError, match=match):
        convert(src, [0, 1], dst, [0, 1], **args)


def test_convert_refuses_other_heads():
    src = random_cache("float16", 16, 0)
    dst = KVCache(KVSpec(LAYERS, HEADS + 1, DIM), NUM_BLOCKS)
    with pytest.raises(ConfigError, match="heads and head_dim must match"):
        convert(src, [0], dst, [0], 16)


def test_convert_to_float8_needs_scales():
    src, dst = random_cache("float16", 16, 0), KVCache(layout("float8", 16), NUM_BLOCKS)
    with pytest.raises(ConfigError, match="scales buffer of 48 B"):
        convert(src, [0, 1], dst, [0, 1], 32)


def test_convert_within_one_cache_needs_disjoint_blocks():
    cache = random_cache("float16", 16, 0)
    with pytest.raises(ConfigError, match="block 1 is both"):
        convert(cache, [0, 1], cache, [1, 2], 32)
    convert(cache, [0, 1], cache, [2, 3], 32)
    assert torch.equal(cache.torch()[:, 2:4], cache.torch()[:, 0:2])


def test_convert_rejects_a_block_out_of_range():
    src, dst = random_cache("float16", 16, 0), random_cache("float16", 16, 1)
    with pytest.raises(BlockError, match=str(NUM_BLOCKS)):
        convert(src, [0, NUM_BLOCKS], dst, [0, 1], 32)
