"""vLLM's KV layouts as the connector wraps them (``config.wrap_kv_caches``), and offload's
path over each: blocks put into a ``KVStore`` in the wrapped order from one set of tensors and
got back into another come back byte for byte, in every layout vLLM's GPU backends hand a
connector (torch CPU tensors in their shapes and strides: the wrapping and the store's path
are the same for device memory, minus the device). No vLLM needed: the platform is passed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kvmove  # noqa: E402 - after the skip
from kvmove.errors import ConfigError  # noqa: E402
from kvmove.integrations.vllm.config import wrap_kv_caches  # noqa: E402

LAYOUT = kvmove.KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16",
                       block_size=16)
BLOCKS = 6


def _flash(seed):        # flash-attention: [2, blocks, block_size, heads, head_dim]
    return torch.randn(2, BLOCKS, 16, 4, 8, generator=_gen(seed)).half()


def _flashinfer(seed):   # FlashInfer NHD: [blocks, 2, block_size, heads, head_dim]
    return torch.randn(BLOCKS, 2, 16, 4, 8, generator=_gen(seed)).half()


def _flashinfer_hnd(seed):
    """FlashInfer HND as vLLM hands it: allocated [blocks, 2, heads, block_size, head_dim],
    viewed (permuted) as the backend's logical [blocks, 2, block_size, heads, head_dim]."""
    return torch.randn(BLOCKS, 2, 4, 16, 8, generator=_gen(seed)).half().permute(0, 1, 3, 2, 4)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


LAYOUTS = {"flash-attention": (_flash, "NHD"), "flashinfer": (_flashinfer, "NHD"),
           "flashinfer-hnd": (_flashinfer_hnd, "HND")}


def _caches(make, seed):
    return {f"model.layers.{i}.self_attn.attn": make(seed + i) for i in range(2)}


def _block(tensor, block, make):
    """Block ``block`` of one layer's tensor, K and V, in the logical shape."""
    return tensor[:, block] if make is _flash else tensor[block]


@pytest.mark.parametrize("name", LAYOUTS)
def test_offload_round_trips_every_gpu_layout(name, tmp_path):
    make, order = LAYOUTS[name]
    source, target = _caches(make, 1), _caches(make, 100)
    expected = {k: v.clone() for k, v in target.items()}
    src = wrap_kv_caches(source, LAYOUT, on_cpu=False)
    dst = wrap_kv_caches(target, LAYOUT, on_cpu=False)
    assert src.order == dst.order == order
    store = kvmove.KVStore(LAYOUT, [kvmove.HostTier(1 << 20),
                                    kvmove.DiskTier(str(tmp_path), 1 << 20)], order=src.order)
    try:
        keys = [11, 12, 13]
        assert store.put(keys, src, [1, 3, 4]).wait(10.0) == 3
        assert store.get(keys, dst, [5, 0, 2]).wait(10.0) == 3
    finally:
        store.close()
    for layer in source:
        for got, put in ((5, 1), (0, 3), (2, 4)):
            assert torch.equal(_block(target[layer], got, make),
                               _block(source[layer], put, make)), (layer, got)
        for untouched in (1, 3):   # blocks not loaded into keep their bytes
            assert torch.equal(_block(target[layer], untouched, make),
                               _block(expected[layer], untouched, make))


def test_a_store_of_one_order_refuses_a_cache_of_another():
    store = kvmove.KVStore(LAYOUT, [kvmove.HostTier(1 << 20)], order="NHD")
    try:
        hnd = wrap_kv_caches(_caches(_flashinfer_hnd, 1), LAYOUT, on_cpu=False)
        with pytest.raises(ConfigError, match="HND order"):
            store.put([1], hnd, [0])
    finally:
        store.close()


def test_the_cpu_backend_is_vllm_cpu_order():
    caches = {f"l{i}": torch.zeros(BLOCKS, 4, 16, 16, dtype=torch.float16) for i in range(2)}
    assert wrap_kv_caches(caches, LAYOUT, on_cpu=True).order == "vllm-cpu"


@pytest.mark.parametrize("shape", [(2, BLOCKS, 16, 4, 9), (BLOCKS, 3, 16, 4, 8),
                                   (BLOCKS, 16, 4, 8)])
def test_an_unknown_layout_is_refused_naming_its_shape(shape):
    caches = {f"l{i}": torch.zeros(*shape, dtype=torch.float16) for i in range(2)}
    with pytest.raises(ConfigError, match=r"none of the layouts"):
        wrap_kv_caches(caches, LAYOUT, on_cpu=False)


def test_a_view_whose_block_dims_moved_is_refused():
    # blocks innermost-but-one in memory: not a layout any backend allocates
    odd = torch.zeros(2, 16, 4, 8, BLOCKS, dtype=torch.float16).permute(0, 4, 1, 2, 3)
    with pytest.raises(ConfigError, match=r"none of the layouts"):
        wrap_kv_caches({"a": odd, "b": odd.clone()}, LAYOUT, on_cpu=False)
