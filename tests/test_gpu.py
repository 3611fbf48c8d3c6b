"""The CUDA half (``KVMOVE_CUDA=1`` builds on a machine with a GPU; skipped cleanly elsewhere,
naming why): device KV caches, pinned host memory, the pack/unpack and convert kernels against
the host path and the torch references, the store over a device cache, GPU-to-GPU and
host<->GPU transfers between processes (every byte checked), and ``save_layer`` waiting on a
CUDA event before posting. ``bench/gpu_check.sh`` runs these, then the GPU benchmarks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmove
from kvmove import Agent, DiskTier, HostTier, KVCache, KVSpec, KVStore
from kvmove.convert import convert, pack, pack_nbytes, unpack
from kvmove.errors import ConfigError

from helpers.convert import CASES, case_id, expected_pack, random_cache, run_convert
from helpers.far import FarPeer
from helpers.gpu_far import gpu_peer
from helpers.kv import pattern


def _why_not() -> str:
    status = kvmove.cuda_status()
    if status.device_count == 0:
        return status.reason
    return "" if torch.cuda.is_available() else "torch has no CUDA here (a CPU build of torch)"


REASON = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(REASON), reason=REASON or "ok")]

DEVICE = "cuda:0"
LAYOUT_KW = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16",
             "block_size": 16}  # 64 KiB per block and layer, as Llama-3.1-8B
LAYOUT = KVSpec(**LAYOUT_KW)
NUM_BLOCKS = 32
TIMEOUT = 30.0


def raw(cache: KVCache) -> torch.Tensor:
    return cache.torch().view(torch.uint8).view(cache.num_layers, cache.num_blocks, -1)


# --- device memory ------------------------------------------------------------------------------

def test_a_device_cache_is_zeroed_and_torch_views_it_without_a_copy():
    cache = KVCache(LAYOUT, NUM_BLOCKS, device=DEVICE)
    view = cache.torch()
    assert view.device == torch.device(DEVICE) and view.shape == cache.shape
    assert not view.view(torch.int16).any()
    view[1, 2].fill_(1.5)
    again = torch.as_tensor(cache, device=DEVICE)  # __cuda_array_interface__
    assert again.data_ptr() == cache.region.addr == view.data_ptr()
    assert torch.equal(cache.torch()[1, 2], torch.full_like(view[1, 2], 1.5))
    assert cache.device == DEVICE and cache.region.device == 0


def test_a_device_cache_has_no_numpy_view_and_no_buffer():
    cache = KVCache(LAYOUT, 4, device=DEVICE)
    with pytest.raises(ConfigError, match="no numpy view"):
        cache.numpy()
    with pytest.raises(AttributeError, match="no __array_interface__"):
        _ = cache.region.__array_interface__


def test_host_memory_is_pinned_when_asked_and_for_store_tiers(tmp_path):
    assert KVCache(LAYOUT, 4, pin=True).region.pinned
    assert KVCache(LAYOUT, 4, pin=None).region.pinned  # None: wherever a GPU is
    assert not KVCache(LAYOUT, 4).region.pinned         # default: no CUDA context for it
    with KVStore(LAYOUT, [HostTier(4 * LAYOUT.bytes_per_block)]) as store:
        assert store._tiers[0].cache.region.pinned


# --- kernels ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [None, [2, 0]])
@pytest.mark.parametrize("ids", [[5], [3, 4, 5, 6], [9, 2, 30, 31, 7]])
def test_pack_and_unpack_kernels_match_the_reference(ids, layers):
    cache = random_cache("float16", 16, 0, DEVICE)
    out = torch.zeros(pack_nbytes(cache, len(ids), layers), dtype=torch.uint8, device=DEVICE)
    pack(cache, ids, out, layers)
    selected = layers or list(range(cache.num_layers))
    assert torch.equal(out, expected_pack(cache, ids, selected))
    other = KVCache(cache.layout, cache.num_blocks, device=DEVICE)
    unpack(out, other, ids, layers)
    assert torch.equal(raw(other)[selected][:, ids], raw(cache)[selected][:, ids])


def test_a_device_cache_needs_a_device_buffer():
    cache = random_cache("float16", 16, 0, DEVICE)
    with pytest.raises(ConfigError, match="must be device memory"):
        pack(cache, [0], np.zeros(pack_nbytes(cache, 1), np.uint8))


@pytest.mark.parametrize("num_tokens", [1, 37, 201])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_convert_kernel_gives_the_host_bits(case, num_tokens):
    got, expected, scales, expected_scales = run_convert(case, num_tokens, device=DEVICE)
    host, host_expected, host_scales, _ = run_convert(case, num_tokens)
    assert torch.equal(got.cpu(), host) and torch.equal(host, host_expected)
    if scales is not None:
        assert torch.equal(scales.cpu(), host_scales)


@pytest.mark.parametrize("merge", [True, False], ids=["tp2-into-tp1", "tp1-into-tp2"])
def test_convert_kernel_moves_a_head_range_as_the_host_does(merge):
    """Heads [2, 4) of 4: a TP rank's half into a whole cache, or a whole cache's into a rank
    (docs/engines.md "Peers that differ"); the device's bytes equal the host's."""
    assert _head_range_convert(merge, DEVICE).equal(_head_range_convert(merge, None))


def _head_range_convert(merge: bool, device: str | None) -> torch.Tensor:
    """The destination's bytes after converting a head range, on ``device`` (None: host)."""
    rank, whole = KVSpec(3, 2, 8, "float16", 4), KVSpec(3, 4, 8, "bfloat16", 16)
    src_layout, dst_layout = (rank, whole) if merge else (whole, rank)
    gen = torch.Generator().manual_seed(3)
    caches = [KVCache(lay, 8, device=device) for lay in (src_layout, dst_layout)]
    for cache in caches:
        view = cache.torch()
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    few, many = [3, 6], [5, 1, 7, 2, 0]  # 19 tokens: 2 blocks of 16, 5 of 4
    convert(caches[0], many if merge else few, caches[1], few if merge else many, 19,
            dst_order="HND", src_heads=(2, 4) if merge else None,
            dst_heads=None if merge else (2, 4))
    return caches[1].torch().cpu().view(torch.uint8)


# --- the store over a device cache --------------------------------------------------------------

def test_store_round_trip_from_and_to_device_memory(tmp_path):
    cache = random_cache("float16", 16, 3, DEVICE)
    hashes = list(range(1, 9))
    with KVStore(cache.layout, [HostTier(4 * cache.layout.bytes_per_block),
                                DiskTier(tmp_path, 1 << 24)], load_policy="always") as store:
        assert store.put(hashes, cache, list(range(8))).wait(TIMEOUT) == 8
        assert store.lookup(hashes).tiers == ("host",) * 4 + ("disk",) * 4
        assert store.get(hashes, cache, list(range(16, 24))).wait(TIMEOUT) == 8
    assert torch.equal(raw(cache)[:, 16:24], raw(cache)[:, 0:8])


# --- transfers between processes ----------------------------------------------------------------

AGENT = {"peer_timeout": 10.0}


def _pair(a: FarPeer, b: FarPeer) -> None:
    a.call("add_peer", b.call("metadata"))
    b.call("add_peer", a.call("metadata"))


def _expect_after_write(src_seed: int, dst_seed: int, src_ids, dst_ids) -> np.ndarray:
    bn = LAYOUT.bytes_per_block_per_layer
    expected = pattern(dst_seed, LAYOUT.num_layers, NUM_BLOCKS, bn).copy()
    expected[:, dst_ids] = pattern(src_seed, LAYOUT.num_layers, NUM_BLOCKS, bn)[:, src_ids]
    return expected


@pytest.mark.parametrize("kinds", [("cuda", "cuda"), ("host", "cuda"), ("cuda", "host")],
                         ids=["gpu-to-gpu", "host-to-gpu", "gpu-to-host"])
def test_a_write_between_processes_lands_every_byte(kinds):
    def start(name: str, kind: str) -> FarPeer:
        if kind == "cuda":
            return gpu_peer(name, LAYOUT_KW, NUM_BLOCKS, AGENT, DEVICE)
        return FarPeer(name, LAYOUT_KW, NUM_BLOCKS, AGENT)

    a = start("src", kinds[0])
    try:
        b = start("dst", kinds[1])
        try:
            a.call("fill", 1)
            b.call("fill", 2)
            _pair(a, b)
            src_ids, dst_ids = [3, 4, 5, 10, 11], [20, 21, 7, 8, 9]
            stats = a.call("write", "dst", src_ids, dst_ids, None, b"done", TIMEOUT)
            assert stats["nbytes"] == len(src_ids) * LAYOUT.bytes_per_block
            assert b.call("wait_notification", TIMEOUT) == ("src", b"done")
            assert np.array_equal(b.call("snapshot"), _expect_after_write(1, 2, src_ids, dst_ids))
        finally:
            b.stop()
    finally:
        a.stop()


def test_save_layer_posts_only_after_its_cuda_event():
    """Each layer is written on a side stream behind a GPU sleep (tens of ms); save_layer gets
    the event recorded after the write. A post that did not wait would send the old (zero)
    bytes. Every ``data`` tensor is kept: freed, torch's allocator could hand its memory to the
    next one on the default stream while the side stream still reads it."""
    cache = KVCache(LAYOUT, NUM_BLOCKS, device=DEVICE)
    far = gpu_peer("receiver", LAYOUT_KW, NUM_BLOCKS, AGENT, DEVICE)
    try:
        with Agent("sender", cache, **AGENT) as agent:
            far.call("add_peer", agent.metadata())
            agent.add_peer(far.call("metadata"))
            ids, remote = [0, 1, 2, 3], [8, 9, 10, 11]
            epoch = far.call("expect", "sender", "req", remote)
            stream = agent.stream_to("receiver", ids, remote, "req", epoch=epoch)
            side, expected, keep = torch.cuda.Stream(), [], []
            for layer in range(LAYOUT.num_layers):
                data = torch.randint(0, 256, (len(ids), cache.block_nbytes), dtype=torch.uint8,
                                     device=DEVICE)
                keep.append(data)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(50_000_000)
                    raw(cache)[layer, ids] = data
                    event = torch.cuda.Event()
                    event.record(side)
                stream.save_layer(layer, event)
                expected.append(data.cpu().numpy())
            stream.finish(b"first-token")
            stream.wait_for_save(TIMEOUT)
            assert far.call("wait_all", "req", TIMEOUT) == b"first-token"
            got = far.call("snapshot")
            for layer in range(LAYOUT.num_layers):
                assert np.array_equal(got[layer, remote], expected[layer]), f"layer {layer}"
    finally:
        far.stop()


# --- an engine's own device tensors (KVCache.wrap, docs/engines.md) -----------------------------

def _flash_tensors(seed: int) -> dict[str, torch.Tensor]:
    """vLLM flash-attention's per-layer [2, N, B, H, D] on the device, random values."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return {f"model.layers.{i}.self_attn.attn":
            torch.randn(shape, generator=g).to(torch.float16).to(DEVICE)
            for i in range(LAYOUT.num_layers)}


def test_wrapped_device_tensors_are_a_device_cache_of_k_and_v_planes():
    tensors = _flash_tensors(1)
    cache = KVCache.wrap(tensors, layout=LAYOUT, block_dim=1, kv_dim=0, pool=None)
    assert cache.device == DEVICE and cache.wrapped and cache.num_parts == 2
    assert cache.layer_names == list(tensors)
    mixed = dict(tensors)
    mixed["model.layers.2.self_attn.attn"] = mixed["model.layers.2.self_attn.attn"].cpu()
    with pytest.raises(ConfigError, match="must agree on devices"):
        KVCache.wrap(mixed, layout=LAYOUT, block_dim=1, kv_dim=0, pool=None)


def test_a_write_from_wrapped_device_tensors_lands_every_byte_in_another_process():
    """vLLM flash tensors on the GPU (K and V planes) written into a kvmove device cache in
    another process: each moved block there is K then V of the engine's block."""
    tensors = _flash_tensors(3)
    cache = KVCache.wrap(tensors, layout=LAYOUT, block_dim=1, kv_dim=0, pool=None)
    far = gpu_peer("dst", LAYOUT_KW, NUM_BLOCKS, AGENT, DEVICE)
    try:
        with Agent("src", cache, **AGENT) as agent:
            far.call("fill", 2)
            far.call("add_peer", agent.metadata())
            agent.add_peer(far.call("metadata"))
            src_ids, dst_ids = [3, 4, 5, 10, 11], [20, 21, 7, 8, 9]
            agent.write("dst", src_ids, dst_ids, notify=b"done").wait(TIMEOUT)
            assert far.call("wait_notification", TIMEOUT) == ("src", b"done")
            after = far.call("snapshot")
        bn = LAYOUT.bytes_per_block_per_layer
        expected = pattern(2, LAYOUT.num_layers, NUM_BLOCKS, bn).copy()
        for layer, t in enumerate(tensors.values()):
            kv = t.cpu().view(torch.uint8).numpy()  # [2, N, B, H, 2 * D]: each plane's bytes
            for s, d in zip(src_ids, dst_ids):
                expected[layer, d] = np.concatenate([kv[0, s].reshape(-1), kv[1, s].reshape(-1)])
        assert np.array_equal(after, expected)
    finally:
        far.stop()
