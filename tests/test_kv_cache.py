"""KVCache: memory order, zero-copy views and coalesced descriptors vs hand-computed offsets."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvmove
from kvmove import KVCache, KVSpec, Region
from kvmove.errors import BlockError, ConfigError

# 3 layers, block of 4 tokens, 2 heads x 8 dims, float16 -> 2*2*8*2 = 64 B/token/layer,
# 256 B per block per layer.
LAYOUT = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
BLOCK = 256


@pytest.fixture
def cache() -> KVCache:
    return KVCache(LAYOUT, num_blocks=10)


def test_geometry(cache):
    assert cache.block_nbytes == BLOCK == LAYOUT.bytes_per_block_per_layer
    assert cache.region.nbytes == 3 * 10 * BLOCK
    assert cache.shape == (3, 10, 2, 4, 2, 8)
    assert cache.pool.num_blocks == 10
    assert cache.pool.num_free == 10


def test_region_is_page_aligned_and_zeroed(cache):
    assert cache.region.addr % 4096 == 0
    assert not cache.numpy().any()


def test_offsets_are_layer_major(cache):
    assert cache.offset(0, 0) == 0
    assert cache.offset(0, 1) == BLOCK
    assert cache.offset(1, 0) == 10 * BLOCK
    assert cache.offset(2, 7) == (2 * 10 + 7) * BLOCK


def test_descriptors_coalesce_runs_per_layer(cache):
    base = cache.region.addr
    got = cache.descriptors([2, 3, 4, 8], layers=[1])
    assert got == [(base + (10 + 2) * BLOCK, 3 * BLOCK), (base + (10 + 8) * BLOCK, BLOCK)]


def test_descriptors_all_layers_in_layer_then_block_order(cache):
    base = cache.region.addr
    got = cache.descriptors([5, 1])
    expected = []
    for layer in range(3):
        expected += [(base + (layer * 10 + 5) * BLOCK, BLOCK),
                     (base + (layer * 10 + 1) * BLOCK, BLOCK)]
    assert got == expected


def test_descriptors_merge_across_adjacent_layers(cache):
    # Layer 0's last run (blocks 8, 9) touches layer 1's first run (blocks 0, 1).
    base = cache.region.addr
    assert cache.descriptors([0, 1, 8, 9], layers=[0, 1]) == [
        (base + 0 * BLOCK, 2 * BLOCK),
        (base + 8 * BLOCK, 4 * BLOCK),
        (base + 18 * BLOCK, 2 * BLOCK),
    ]
    # In the other order nothing touches.
    assert len(cache.descriptors([8, 9, 0, 1], layers=[0, 1])) == 4
    assert cache.descriptors(list(range(10))) == [(base, cache.region.nbytes)]


def test_descriptors_empty_inputs(cache):
    assert cache.descriptors([]) == []
    assert cache.descriptors([1, 2], layers=[]) == []


def test_descriptors_reject_block_out_of_range(cache):
    with pytest.raises(BlockError, match="block id 10 is out of range.*\\[0, 10\\)"):
        cache.descriptors([1, 10])
    with pytest.raises(BlockError, match="block id -1"):
        cache.descriptors([-1])


def test_descriptors_reject_layer_out_of_range(cache):
    with pytest.raises(ConfigError, match="layer 3 is out of range.*\\[0, 3\\)"):
        cache.descriptors([1], layers=[0, 3])


def test_numpy_view_writes_land_at_descriptor_addresses(cache):
    view = cache.numpy()
    assert view.dtype == np.float16
    view[1, 4, 1, 2, 1, 3] = 7.5  # layer 1, block 4, V, token 2, head 1, dim 3
    (addr, nbytes), = cache.descriptors([4], layers=[1])
    raw = np.asarray(cache.region)
    block = raw[addr - cache.region.addr: addr - cache.region.addr + nbytes].view(np.float16)
    # Inside a block: K [B, H, D] then V [B, H, D].
    assert block[4 * 2 * 8 + (2 * 2 + 1) * 8 + 3] == 7.5
    assert np.count_nonzero(raw) == 2  # one float16 = two bytes, nothing else touched


def test_numpy_view_is_zero_copy(cache):
    a, b = cache.numpy(), cache.numpy()
    a[0, 0, 0, 0, 0, 0] = 1.0
    assert b[0, 0, 0, 0, 0, 0] == 1.0
    assert a.ctypes.data == cache.region.addr


def test_view_keeps_cache_memory_alive():
    view = KVCache(LAYOUT, num_blocks=2).numpy()
    view[...] = 3.0  # the cache object is gone; its memory must not be
    assert float(view.sum()) == 3.0 * view.size


@pytest.mark.parametrize(("dtype", "np_dtype"), [("bfloat16", np.uint16), ("float8", np.uint8),
                                                 ("float32", np.float32)])
def test_numpy_dtypes(dtype, np_dtype):
    lay = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=dtype, block_size=2)
    view = KVCache(lay, num_blocks=3).numpy()
    assert view.dtype == np_dtype
    assert view.shape == (2, 3, 2, 2, 1, 4)


def test_torch_view_is_zero_copy_in_layout_dtype():
    torch = pytest.importorskip("torch")
    lay = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype="bfloat16", block_size=2)
    cache = KVCache(lay, num_blocks=3)
    t = cache.torch()
    assert t.dtype == torch.bfloat16
    assert tuple(t.shape) == cache.shape
    assert t.data_ptr() == cache.region.addr
    t[1, 2, 1, 1, 0, 3] = 1.5
    assert cache.numpy()[1, 2, 1, 1, 0, 3] == torch.tensor(1.5, dtype=torch.bfloat16).view(
        torch.uint16).item()


def test_huge_page_region_is_aligned_to_2mib():
    region = Region(3 << 20, huge_pages=True)
    assert region.addr % (2 << 20) == 0
    assert region.huge_pages
    view = np.asarray(region)
    view[-1] = 9
    assert view.size == 3 << 20 and view[-1] == 9


def test_region_rejects_zero_bytes():
    with pytest.raises(ConfigError, match="nbytes must be positive, got 0"):
        Region(0)


def test_region_too_large_is_an_allocation_error():
    with pytest.raises(kvmove.errors.AllocationError, match="cannot map"):
        Region(1 << 62)


@pytest.mark.parametrize("num_blocks", [0, -1, 2**31])
def test_cache_rejects_bad_num_blocks(num_blocks):
    with pytest.raises(ConfigError, match=f"num_blocks must be in .* got {num_blocks}"):
        KVCache(LAYOUT, num_blocks=num_blocks)


def test_cache_rejects_size_overflow():
    huge = KVSpec(num_layers=2**20, num_kv_heads=2**10, head_dim=2**10, block_size=2**10)
    with pytest.raises(ConfigError, match="overflows 64 bits"):
        KVCache(huge, num_blocks=2**20)


def test_core_imports_without_torch(tmp_path):
    # Run outside the checkout so the installed package is imported, not the source tree.
    code = "import sys; sys.modules['torch'] = None; import kvmove; print(kvmove.ucx_version())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    assert out.stdout.strip().startswith("1.")
