"""``kvmove.KVCache.wrap`` (docs/engines.md): engines' own KV tensors, moved between processes.

Each engine's tensors have their real shapes (small sizes, helpers/engines.py). The near cache
lives in the test process, the far one in a spawned child (helpers/wrap_far.py); every byte
moves through ``kvmove.Agent`` and UCX (tcp). Every check reads blocks through the torch
reference ``engines.kv_of`` (which element of which engine tensor holds K or V of token t,
head h), never through kvmove's planes: moved blocks must equal their source element by
element, and every other block (and layer) must be what it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmove
from kvmove.bench.harness import ChildError
from kvmove.errors import ConfigError
from kvmove.wrap import planes_of

from helpers import engines
from helpers.wrap_far import FarWrapped, as_torch

TCP = {"transports": "tcp", "error_mode": "peer"}
NUM_BLOCKS = 12
WAIT = 10.0
SRC = [1, 2, 3, 9, 0, 7]  # scattered, with a run of three
DST = [4, 5, 6, 11, 8, 2]

# (near engine, far engine): every row of the table, wrapped <-> wrapped, and
# wrapped <-> kvmove's own cache (K and V apart on one side, together on the other included).
PAIRS = [
    ("flash", "flash"), ("flashinfer", "flashinfer"), ("vllm-cpu", "vllm-cpu"),
    ("sglang", "sglang"), ("mla", "mla"), ("flash-hnd", "flash-hnd"),
    ("flash", "native"), ("native", "flash"), ("flashinfer", "native"), ("sglang", "native"),
    ("flash", "sglang"), ("sglang", "flashinfer"), ("mla", "native-mla"), ("native-mla", "mla"),
]


class Near:
    """An engine's wrapped cache and an agent in this process, peered with a far one."""

    def __init__(self, engine: str, far_engine: str, layout: kvmove.KVSpec | None = None,
                 far_layout: kvmove.KVSpec | None = None) -> None:
        self.engine, self.far_engine = engine, far_engine
        self.layout = layout or engines.layout_for(engine)
        self.far_layout = far_layout or self.layout
        self.tensors, self.cache = engines.make(engine, self.layout, NUM_BLOCKS)
        self.far = FarWrapped("far", far_engine, self.far_layout, NUM_BLOCKS, TCP)
        self.agent = kvmove.Agent("near", self.cache, **TCP)
        self.agent.add_peer(self.far.call("metadata"))
        self.far.call("add_peer", self.agent.metadata())

    def close(self) -> None:
        self.agent.close()
        self.far.stop()

    def fill(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Random contents on both sides; (near, far) copies."""
        engines.fill(self.tensors, 1)
        self.far.call("fill", 2)
        return engines.snapshot(self.tensors), self.far_snapshot()

    def far_snapshot(self) -> list[torch.Tensor]:
        return as_torch(self.far.call("snapshot"))


@pytest.fixture
def near_of(request):
    made: list[Near] = []

    def make(*args, **kwargs) -> Near:
        made.append(Near(*args, **kwargs))
        return made[-1]

    yield make
    for near in made:
        near.close()


def assert_moved(dst_engine: str, got: list[torch.Tensor], before: list[torch.Tensor],
                 src_engine: str, src: list[torch.Tensor], layout: kvmove.KVSpec,
                 pairs: dict[int, int], layers: list[int]) -> None:
    """Destination block d of each layer in ``layers`` holds source block pairs[d]; every
    other block of every layer is as it was."""
    for layer in range(layout.num_layers):
        for block in range(NUM_BLOCKS):
            now = engines.kv_of(dst_engine, got, layout, layer, block)
            if layer in layers and block in pairs:
                want = engines.kv_of(src_engine, src, layout, layer, pairs[block])
                where = f"layer {layer} block {block} <- {pairs[block]}"
            else:
                want = engines.kv_of(dst_engine, before, layout, layer, block)
                where = f"layer {layer} block {block} (untouched)"
            assert torch.equal(now, want), where


def assert_unchanged(engine: str, got: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    for now, was in zip(got, before):
        assert torch.equal(now, was), f"the {engine} side changed"


# --- moving every engine's blocks ------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=["->".join(p) for p in PAIRS])
def test_write_moves_every_element_to_its_place(near_of, pair):
    near = near_of(*pair)
    src, before = near.fill()
    near.agent.write("far", SRC, DST).wait(WAIT)
    assert_moved(near.far_engine, near.far_snapshot(), before, near.engine, src, near.layout,
                 dict(zip(DST, SRC)), list(range(near.layout.num_layers)))
    assert_unchanged(near.engine, engines.snapshot(near.tensors), src)


@pytest.mark.parametrize("pair", [("flash", "flashinfer"), ("vllm-cpu", "vllm-cpu"),
                                  ("native", "sglang")], ids=lambda p: "<-".join(p))
def test_read_pulls_every_element_to_its_place(near_of, pair):
    near = near_of(*pair)
    mine, theirs = near.fill()
    near.agent.read("far", DST, SRC).wait(WAIT)
    assert_moved(near.engine, engines.snapshot(near.tensors), mine, near.far_engine, theirs,
                 near.layout, dict(zip(DST, SRC)), list(range(near.layout.num_layers)))
    assert_unchanged(near.far_engine, near.far_snapshot(), theirs)


@pytest.mark.parametrize("pair", [("flash", "sglang"), ("mla", "native-mla")],
                         ids=lambda p: "->".join(p))
def test_a_subset_of_layers_moves_only_those(near_of, pair):
    near = near_of(*pair)
    src, before = near.fill()
    near.agent.write("far", SRC, DST, layers=[2, 0]).wait(WAIT)
    assert_moved(near.far_engine, near.far_snapshot(), before, near.engine, src, near.layout,
                 dict(zip(DST, SRC)), [0, 2])


@pytest.mark.parametrize("pair", [("flash", "sglang"), ("vllm-cpu", "vllm-cpu"),
                                  ("native", "flashinfer")], ids=lambda p: "->".join(p))
def test_a_layer_stream_fills_the_far_lease(near_of, pair):
    near = near_of(*pair)
    src, before = near.fill()
    epoch = near.far.call("expect", "near", "req-1", DST)
    stream = near.agent.stream_to("far", SRC, DST, "req-1", epoch=epoch)
    for layer in reversed(range(near.layout.num_layers)):
        stream.save_layer(layer)
    stream.finish(b"tok")
    stream.wait_for_save(WAIT)
    assert near.far.call("wait_all", "req-1") == b"tok"
    assert_moved(near.far_engine, near.far_snapshot(), before, near.engine, src, near.layout,
                 dict(zip(DST, SRC)), list(range(near.layout.num_layers)))


@pytest.mark.parametrize("pair", [("flash", "native"), ("native", "sglang"),
                                  ("flashinfer", "flash")], ids=lambda p: "->".join(p))
def test_checksums_agree_where_the_sides_split_blocks_differently(near_of, pair):
    """A block's checksum is over its bytes, not its parts: K and V apart on one side and
    together on the other still verify."""
    near = near_of(*pair)
    src, before = near.fill()
    epoch = near.far.call("expect", "near", "req-3", DST)
    stream = near.agent.stream_to("far", SRC, DST, "req-3", epoch=epoch, checksums=True)
    for layer in range(near.layout.num_layers):
        stream.save_layer(layer)
    stream.wait_for_save(WAIT)
    assert near.far.call("wait_all", "req-3") == b""
    assert_moved(near.far_engine, near.far_snapshot(), before, near.engine, src, near.layout,
                 dict(zip(DST, SRC)), list(range(near.layout.num_layers)))


def test_a_far_wrapped_stream_lands_in_a_near_wrapped_lease(near_of):
    near = near_of("sglang", "flash")
    mine, theirs = near.fill()
    load = near.agent.expect("far", "req-2", DST).start_load()
    near.far.call("stream", "near", SRC, DST, "req-2", load.epoch, b"first", WAIT)
    assert load.wait_all(WAIT) == b"first"
    assert_moved("sglang", engines.snapshot(near.tensors), mine, "flash", theirs, near.layout,
                 dict(zip(DST, SRC)), list(range(near.layout.num_layers)))


# --- one post per contiguous run per plane -----------------------------------------------------

@pytest.mark.parametrize("pair, ops_per_layer", [
    (("flashinfer", "native"), 1),  # one plane each side, dense: the run is one op
    (("flash", "flash"), 2),        # K and V planes, dense on both sides: one op per plane
    (("sglang", "flash"), 2),
    (("vllm-cpu", "vllm-cpu"), 1),
    (("flash", "native"), 2 * 8),   # K and V apart here, together there: one op per piece
], ids=lambda v: "->".join(v) if isinstance(v, tuple) else str(v))
def test_a_run_of_blocks_is_one_op_per_plane(near_of, pair, ops_per_layer):
    near = near_of(*pair)
    near.fill()
    transfer = near.agent.write("far", list(range(2, 10)), list(range(3, 11)))
    transfer.wait(WAIT)
    assert transfer.stats.num_ops == ops_per_layer * near.layout.num_layers
    assert transfer.stats.nbytes == 8 * near.layout.bytes_per_block


# --- peers whose layouts differ: refused before any byte moves ---------------------------------

MISMATCHES = {
    "order": ("flash", "vllm-cpu", None, "order: NHD here, vllm-cpu at 'far'"),
    "nhd-vs-hnd": ("flash-hnd", "flashinfer", None, "order: HND here, NHD at 'far'"),
    "block-size": ("flash", "flash", engines.layout_for("flash", block_size=8),
                   "block_size: 4 here, 8 at 'far'"),
    "layers": ("flashinfer", "native", engines.layout_for("native", num_layers=2),
               "num_layers: 3 here, 2 at 'far'"),
    "mla-vs-kv": ("native", "native-mla", None, "num_kv_heads: 2 here, 1 at 'far'"),
}


@pytest.mark.parametrize("case", MISMATCHES, ids=list(MISMATCHES))
def test_a_peer_whose_layout_differs_is_refused_naming_the_difference(near_of, case):
    engine, far_engine, far_layout, difference = MISMATCHES[case]
    near = near_of(engine, far_engine, far_layout=far_layout or engines.layout_for(far_engine))
    src, before = near.fill()
    with pytest.raises(ConfigError, match="KV layouts differ: " + difference):
        near.agent.write("far", [0], [0])
    with pytest.raises(ConfigError, match="KV layouts differ: " + difference):
        near.agent.stream_to("far", [0], [0], "req-x", epoch=1 << 32 | 1)
    with pytest.raises(ChildError, match="KV layouts differ") as refused:  # and the other way
        near.far.call("write", "near", [0], [0])
    assert refused.value.kind == "ConfigError"
    assert_unchanged(far_engine, near.far_snapshot(), before)
    assert_unchanged(engine, engines.snapshot(near.tensors), src)


# --- the geometry of a wrap --------------------------------------------------------------------

@pytest.mark.parametrize("engine, order, segments", [
    ("flash", "NHD", 3), ("sglang", "NHD", 6), ("vllm-cpu", "vllm-cpu", 3), ("mla", "mla", 3),
    ("native", "NHD", 1)])
def test_the_metadata_carries_the_planes_the_segments_and_the_order(engine, order, segments):
    """One registered segment (one key) per engine tensor, the planes as the cache has them."""
    layout = engines.layout_for(engine)
    _, cache = engines.make(engine, layout, NUM_BLOCKS)
    with kvmove.Agent("meta", cache, **TCP) as agent:
        meta = kvmove._C.decode_metadata(agent.key.verify(agent.metadata()))
    assert meta["order"] == order
    assert [s[:2] for s in meta["segments"]] == cache._core.segments
    assert len(meta["segments"]) == segments and all(s[2] for s in meta["segments"])
    assert meta["planes"] == cache._core.planes
    assert meta["num_parts"] == cache.num_parts
    assert meta["block_nbytes"] == layout.bytes_per_block_per_layer


def test_wrap_is_zero_copy_and_keeps_the_tensors():
    layout = engines.layout_for("flash")
    kv = engines.allocate("flash", layout, NUM_BLOCKS)
    cache = engines.wrap("flash", kv, layout)
    first = next(iter(kv.values()))
    assert cache.tensors[0] is first and cache.layer_names == list(kv)
    assert cache.pool is None and cache.region is None and cache.wrapped
    block = layout.bytes_per_block_per_layer // 2  # K (or V) of one block
    assert cache.descriptors([3], [0]) == [(first[0, 3].data_ptr(), block),
                                           (first[1, 3].data_ptr(), block)]
    assert cache.descriptors([0, 1, 2], [0])[0] == (first.data_ptr(), 3 * block)
    first[1, 3] = 7  # the engine writes; kvmove sees its bytes
    view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint16 * 1).from_address(
        cache.descriptors([3], [0])[1][0]))
    assert view[0] == np.float16(7).view(np.uint16)


@pytest.mark.parametrize("engine", ["flash", "vllm-cpu", "sglang", "mla"])
def test_numpy_arrays_wrap_as_their_torch_tensors_do(engine):
    layout = engines.layout_for(engine)
    tensors = engines.allocate(engine, layout, NUM_BLOCKS)
    as_numpy = [tuple(t.numpy() for t in e) if isinstance(e, tuple) else e.numpy()
                for e in (tensors.values() if isinstance(tensors, dict) else tensors)]
    from_torch = engines.wrap(engine, tensors, layout)
    from_numpy = engines.wrap(engine, as_numpy, layout)
    assert from_numpy._core.planes == from_torch._core.planes
    assert from_numpy._core.segments == from_torch._core.segments


def test_a_wrap_with_a_pool_allocates_like_a_native_cache():
    layout = engines.layout_for("sglang")
    cache = engines.wrap("sglang", engines.allocate("sglang", layout, NUM_BLOCKS), layout,
                         pool=True)
    assert cache.pool is not None and cache.pool.num_free == NUM_BLOCKS
    assert len(cache.pool.allocate(5)) == 5 and cache.pool.num_free == NUM_BLOCKS - 5


def test_kvmoves_own_cache_is_one_instance_of_the_same_geometry():
    """Wrapping a native cache's own memory as FlashInfer-style layers gives its planes."""
    layout = engines.layout_for("native")
    native = kvmove.KVCache(layout, NUM_BLOCKS)
    view = native.torch()  # [L, N, 2, B, H, D]
    wrapped = kvmove.KVCache.wrap([view[i] for i in range(layout.num_layers)], layout=layout,
                                  block_dim=0, kv_dim=1)
    strip = [p[:3] for p in native._core.planes]
    assert [p[:3] for p in wrapped._core.planes] == strip
    ids = [5, 6, 7, 1]
    assert wrapped.descriptors(ids) != [] and native.descriptors(ids, [1]) == \
        wrapped.descriptors(ids, [1])


# --- wrap errors: each its own message ----------------------------------------------------------

def _flash(layout: kvmove.KVSpec, **change) -> list[torch.Tensor]:
    shape = change.pop("shape", (2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads,
                                 layout.head_dim))
    return [torch.zeros(shape, dtype=change.pop("dtype", torch.float16))
            for _ in range(layout.num_layers)]


LAYOUT = engines.layout_for("flash")  # 3 layers, 2 heads of 8, block 4, float16
FLASH = dict(layout=LAYOUT, block_dim=1, kv_dim=0)


def test_wrap_refuses_a_wrong_head_count():
    kv = _flash(LAYOUT, shape=(2, NUM_BLOCKS, 4, 3, 8))
    with pytest.raises(ConfigError, match=r"tensor tensors\[0\] dim 3 is 3, expected "
                                          r"num_kv_heads = 2"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_a_missing_dimension():
    kv = _flash(LAYOUT, shape=(2, NUM_BLOCKS, 4, 16))
    with pytest.raises(ConfigError, match=r"tensors\[0\] has 4 dims .*a block needs 3 dims "
                                          r"after the block dim \(block_size, num_kv_heads"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_takes_an_hnd_allocation_viewed_as_nhd_in_its_memory_order():
    # vLLM hands FlashInfer's HND allocation over as an NHD view: wrapped as HND, as stored
    hnd = _flash(LAYOUT, shape=(2, NUM_BLOCKS, 2, 4, 8))
    for layer, t in enumerate(hnd):
        t.copy_(torch.arange(t.numel(), dtype=torch.float16).reshape(t.shape) + layer)
    views = [t.transpose(2, 3) for t in hnd]
    cache = kvmove.KVCache.wrap(views, **FLASH)
    assert cache.order == "HND"
    # the same planes as the allocation wrapped in its own order (where each block lies)
    assert planes_of(views, LAYOUT, 1, 0, "NHD", None) == planes_of(hnd, LAYOUT, 1, 0, "HND",
                                                                     None)


def test_wrap_refuses_a_view_of_the_other_order_in_mixed_orders():
    kv = _flash(LAYOUT)
    kv[1] = kv[1].transpose(2, 3).contiguous().transpose(2, 3)   # this layer's memory is HND
    with pytest.raises(ConfigError, match=r"the tensors must agree on the order of a block in "
                                          r"memory: tensor tensors\[1\] has HND"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_a_plane_not_contiguous_inside_a_block():
    kv = [t.transpose(3, 4).contiguous().transpose(3, 4) for t in _flash(LAYOUT)]  # [.., D, H]
    with pytest.raises(ConfigError, match=r"tensors\[0\] is not contiguous inside a block: dim "
                                          r"4 \(head_dim\) has a stride of 4 B, expected "
                                          r"2 B"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_blocks_that_overlap():
    t = torch.zeros(2, NUM_BLOCKS * 4 * 2 * 8, dtype=torch.float16)
    kv = [t.as_strided((2, NUM_BLOCKS, 4, 2, 8), (t.stride(0), 8, 16, 8, 1))
          for _ in range(LAYOUT.num_layers)]
    with pytest.raises(ConfigError, match=r"dim 1 \(blocks\) has a stride of 16 B, expected at "
                                          r"least the block's 128 B"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_mixed_devices():
    kv = _flash(LAYOUT)
    kv[2] = kv[2].to("meta")
    with pytest.raises(ConfigError, match=r"must agree on devices: tensor tensors\[2\] has "
                                          r"meta, tensor tensors\[0\] has cpu"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_a_device_it_cannot_reach():
    kv = [t.to("meta") for t in _flash(LAYOUT)]
    with pytest.raises(ConfigError, match=r"tensors\[0\] is on meta: kvmove wraps host"):
        kvmove.KVCache.wrap(kv, **FLASH)


@pytest.mark.skipif(kvmove.cuda_status().built, reason="a CUDA build wraps CUDA tensors")
def test_wrap_refuses_cuda_tensors_in_a_cpu_build():
    class FakeCuda:  # what a CUDA tensor shows before anything is read from it
        device = torch.device("cuda", 0)
        dtype = torch.float16
        shape = (2, NUM_BLOCKS, 4, 2, 8)

        def data_ptr(self) -> int:
            raise AssertionError("read before the device was checked")

        def stride(self) -> tuple[int, ...]:
            raise AssertionError("read before the device was checked")

    with pytest.raises(ConfigError, match="built without CUDA"):
        kvmove.KVCache.wrap([FakeCuda() for _ in range(3)], **FLASH)


def test_wrap_refuses_a_dtype_mismatch():
    kv = _flash(LAYOUT, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"tensor tensors\[0\] has dtype bfloat16, the "
                                          r"layout's is float16"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_the_wrong_layer_count():
    with pytest.raises(ConfigError, match=r"got 2 layers of tensors, the layout has 3"):
        kvmove.KVCache.wrap(_flash(LAYOUT)[:2], **FLASH)


def test_wrap_refuses_layers_with_different_block_counts():
    kv = _flash(LAYOUT)
    kv[1] = torch.zeros(2, NUM_BLOCKS - 1, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"agree on numbers of blocks: tensor tensors\[1\] "
                                          rf"has {NUM_BLOCKS - 1}"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_a_kv_dim_that_is_not_two():
    kv = [torch.zeros(3, NUM_BLOCKS, 4, 2, 8, dtype=torch.float16) for _ in range(3)]
    with pytest.raises(ConfigError, match=r"dim 0 \(kv_dim\) is 3, expected 2 \(K and V\)"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_names_a_dict_layer_by_its_name():
    kv = {f"layers.{i}": t for i, t in enumerate(_flash(LAYOUT, dtype=torch.float32))}
    with pytest.raises(ConfigError, match="tensor 'layers.0' has dtype float32"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_wrap_refuses_an_order_the_layout_cannot_hold():
    with pytest.raises(ConfigError, match="order 'mla' needs a layout with mla=True"):
        kvmove.KVCache.wrap(_flash(LAYOUT), layout=LAYOUT, block_dim=0, order="mla")
    with pytest.raises(ConfigError, match="order must be one of"):
        kvmove.KVCache.wrap(_flash(LAYOUT), layout=LAYOUT, block_dim=1, kv_dim=0, order="NDH")


def test_wrap_refuses_a_page_size_that_is_not_the_block_size():
    layout = engines.layout_for("sglang")
    kv = engines.allocate("sglang", layout, NUM_BLOCKS)
    with pytest.raises(ConfigError, match="page_size 8 must equal the layout's block_size 4"):
        kvmove.KVCache.wrap(kv, layout=layout, block_dim=0, page_size=8)


def test_wrap_refuses_a_token_count_that_is_not_whole_pages():
    layout = engines.layout_for("sglang")
    kv = [(torch.zeros(10, 2, 8, dtype=torch.float16),) * 2 for _ in range(3)]
    with pytest.raises(ConfigError, match=r"dim 0 holds 10 tokens, expected a multiple of "
                                          r"page_size 4"):
        kvmove.KVCache.wrap(kv, layout=layout, block_dim=0, page_size=4)


def test_wrap_refuses_a_read_only_array():
    kv = [np.zeros((2, NUM_BLOCKS, 4, 2, 8), np.float16) for _ in range(3)]
    kv[1].flags.writeable = False
    with pytest.raises(ConfigError, match=r"tensor tensors\[1\] is read-only"):
        kvmove.KVCache.wrap(kv, **FLASH)


def test_a_wrapped_cache_has_no_numpy_view():
    layout = engines.layout_for("mla")
    cache = engines.wrap("mla", engines.allocate("mla", layout, NUM_BLOCKS), layout)
    with pytest.raises(ConfigError, match="laid out by its engine"):
        cache.numpy()


# --- the disk tier reads and writes a wrapped cache's blocks part by part -----------------------

@pytest.mark.parametrize("engine", ["flash", "sglang", "mla"])
def test_a_disk_tier_round_trips_a_wrapped_cache(tmp_path, engine):
    layout = engines.layout_for(engine)
    tensors, cache = engines.make(engine, layout, NUM_BLOCKS)
    engines.fill(tensors, 3)
    before = engines.snapshot(tensors)
    store = kvmove.KVStore(layout, [kvmove.DiskTier(str(tmp_path), 1 << 22)], namespace=engine)
    try:
        hashes = kvmove.block_hashes(list(range(3 * layout.block_size)), layout.block_size)
        store.put(hashes, cache, [1, 5, 7]).wait(timeout=WAIT)
        engines.fill(tensors, 4)
        changed = engines.snapshot(tensors)
        assert store.lookup(hashes).tiers == ("disk",) * 3
        store.get(hashes, cache, [2, 3, 4]).wait(timeout=WAIT)
    finally:
        store.close()
    assert_moved(engine, engines.snapshot(tensors), changed, engine, before, layout,
                 {2: 1, 3: 5, 4: 7}, list(range(layout.num_layers)))


def test_a_disk_tiers_fingerprint_is_unchanged_for_layouts_without_mla(tmp_path):
    """Disk tiers written before KVSpec had ``mla`` keep opening: the field is in the
    fingerprint only when it is set."""
    import json
    import struct

    for layout, has_mla in ((engines.layout_for("flash"), False), (engines.layout_for("mla"),
                                                                    True)):
        path = tmp_path / str(has_mla)
        kvmove.KVStore(layout, [kvmove.DiskTier(str(path), 1 << 20)]).close()
        header = (path / "index.kvm").read_bytes()
        (n,) = struct.unpack_from("<I", header, 12)
        fingerprint = json.loads(header[16:16 + n])
        assert ("mla" in fingerprint["layout"]) == has_mla


# --- a store keeps blocks in one order -----------------------------------------------------

def test_a_store_takes_caches_of_its_own_order_only(tmp_path):
    """A vllm-cpu cache's blocks interleave K and V; an NHD store must not hand them to an NHD
    cache (or take them from one): put and get refuse a cache of another order, naming both."""
    layout = engines.layout_for("vllm-cpu")
    tensors, cache = engines.make("vllm-cpu", layout, NUM_BLOCKS)
    with kvmove.KVStore(layout, [kvmove.HostTier(1 << 20)], namespace="m") as store:
        for call in (store.put, store.get):
            with pytest.raises(ConfigError, match="vllm-cpu order, the store's in NHD"):
                call([1, 2], cache, [0, 1])


def test_a_store_of_the_engines_order_round_trips_its_blocks_and_keeps_the_order_on_disk(
        tmp_path):
    layout = engines.layout_for("vllm-cpu")
    tensors, cache = engines.make("vllm-cpu", layout, NUM_BLOCKS)
    engines.fill(tensors, 5)
    before = engines.snapshot(tensors)
    tiers = [kvmove.DiskTier(str(tmp_path), 1 << 20)]
    with kvmove.KVStore(layout, tiers, namespace="m", order="vllm-cpu") as store:
        assert store.put([11, 12, 13], cache, [1, 2, 3]).wait(WAIT) == 3
        assert store.get([11, 12, 13], cache, [7, 8, 9]).wait(WAIT) == 3
    after = engines.snapshot(tensors)
    for layer in range(layout.num_layers):
        for src, dst in ((1, 7), (2, 8), (3, 9)):
            assert torch.equal(engines.kv_of("vllm-cpu", after, layout, layer, dst),
                               engines.kv_of("vllm-cpu", before, layout, layer, src))
    with pytest.raises(kvmove.errors.StoreError):  # written in vllm-cpu order: not an NHD store
        kvmove.KVStore(layout, tiers, namespace="m")
