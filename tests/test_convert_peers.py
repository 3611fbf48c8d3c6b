"""Peers whose layouts differ (kvmove.staging, docs/engines.md "Peers that differ"): the sender
writes or streams its own layout into a ``StagingArea``'s blocks, and the receiver converts them
on arrival into its cache.

The sender is an engine's wrapped tensors (or kvmove's own cache) in a spawned child
(helpers/wrap_far.py); every byte moves through ``kvmove.Agent`` and UCX (tcp). The expected
destination is built with torch from the sender's values (the child fills its tensors from a
seed; this process makes the same tensors from the same seed) and ``engines.kv_of``, never
through kvmove: converted tokens must equal the reference element by element, and every other
block, and the positions past the sequence in its last block, must keep their bytes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest
import torch

import kvmove
from kvmove.convert import convert
from kvmove.errors import ConfigError
from kvmove.staging import StagingArea

from helpers import engines
from helpers.checks import wait_until
from helpers.wrap_far import FarWrapped

TCP = {"transports": "tcp", "error_mode": "peer"}
WAIT = 10.0
NUM_BLOCKS = 16
SEED = 5

# name: (sender engine, sender block size, sender dtype, receiver order, receiver block size,
#        receiver dtype, receiver engine: None for a kvmove KVCache, else the engine whose
#        wrapped tensors it is: FlashInfer's one plane, or vLLM flash's K and V planes)
CASES = {
    "block-4-to-16": ("flash", 4, "float16", "NHD", 16, "float16", None),
    "block-16-to-4": ("native", 16, "float16", "NHD", 4, "float16", "flashinfer"),
    "nhd-to-hnd": ("flashinfer", 4, "float16", "HND", 4, "float16", None),
    "hnd-to-nhd": ("flash-hnd", 4, "float16", "NHD", 4, "float16", "flashinfer"),
    "float16-to-bfloat16": ("flash", 4, "float16", "NHD", 4, "bfloat16", None),
    "bfloat16-hnd-4-to-float16-nhd-16": ("flash-hnd", 4, "bfloat16", "NHD", 16, "float16",
                                         None),
    "block-4-to-16-into-k-and-v-planes": ("native", 4, "float16", "NHD", 16, "float16",
                                          "flash"),
    "nhd-float16-to-hnd-bfloat16-k-and-v-planes": ("flash", 4, "float16", "HND", 4,
                                                   "bfloat16", "flash-hnd"),
}
SENDER_ORDERS = {"flash-hnd": "HND"}  # else NHD


class Receiver:
    """The decode side: its own cache (the conversion's destination) and a staging area in the
    sender's layout; the sender in a child, peered with the staging agent."""

    def __init__(self, case: str) -> None:
        engine, bs, dtype, order, dst_bs, dst_dtype, wrapped = CASES[case]
        self.wrapped = wrapped
        self.engine = engine
        self.src_layout = engines.layout_for(engine, block_size=bs, dtype=dtype)
        self.layout = engines.layout_for("native", block_size=dst_bs, dtype=dst_dtype)
        self.order = order
        self.cache = _receiver_cache(self.layout, order, wrapped)
        self.area = StagingArea("decode/staging", self.cache, sender_layout=self.src_layout,
                                sender_order=SENDER_ORDERS.get(engine, "NHD"),
                                num_blocks=NUM_BLOCKS, **TCP)
        self.far = FarWrapped("prefill", engine, self.src_layout, NUM_BLOCKS, TCP)
        self.area.agent.add_peer(self.far.call("metadata"))
        self.far.call("add_peer", self.area.agent.metadata())
        self.far.call("fill", SEED)
        self.src_tensors, _ = engines.make(engine, self.src_layout, NUM_BLOCKS)
        engines.fill(self.src_tensors, SEED)  # the same values as the child's
        if wrapped:
            engines.fill(self.cache.tensors, 9)
        else:
            self.cache.torch().copy_(torch.randn(self.cache.shape).to(self.cache.torch().dtype))

    def close(self) -> None:
        self.area.close()
        self.far.stop()

    def expected(self, src_ids: list[int], dst_ids: list[int], num_tokens: int,
                 before: torch.Tensor) -> torch.Tensor:
        """The receiver's [L, N, 2, B, H, D] after the conversion (torch reference)."""
        out = before.clone()
        leaves = engines.leaves(self.src_tensors)
        b = self.layout.block_size
        for layer in range(self.layout.num_layers):
            seq = torch.cat([engines.kv_of(self.engine, leaves, self.src_layout, layer, i)
                             for i in src_ids], dim=1)[:, :num_tokens]  # [2, T, H, D]
            for bi, block in enumerate(dst_ids):
                part = seq[:, bi * b:(bi + 1) * b]
                out[layer, block, :, :part.shape[1]] = part.to(out.dtype)
        return out


def _receiver_cache(layout: kvmove.KVSpec, order: str, wrapped: str | None
                    ) -> kvmove.KVCache:
    if wrapped:  # FlashInfer's [N, 2, B, H, D] per layer, or flash's [2, N, B, H, D] (HND too)
        _, cache = engines.make(wrapped, layout, NUM_BLOCKS)
        return cache
    return kvmove.KVCache(layout, NUM_BLOCKS, order=order)


def blocks_view(cache: kvmove.KVCache, layout: kvmove.KVSpec, order: str,
                wrapped: str | None = None) -> torch.Tensor:
    """[L, N, 2, B, H, D] of the receiver's cache, read with torch (HND transposed); a
    wrapped one through the engines' reference (``engines.kv_of``)."""
    if wrapped:
        leaves = engines.leaves(cache.tensors)
        return torch.stack([torch.stack([engines.kv_of(wrapped, leaves, layout, layer, block)
                                         for block in range(cache.num_blocks)])
                            for layer in range(layout.num_layers)])
    t = cache.torch()
    return t.transpose(3, 4) if order == "HND" else t


@pytest.fixture
def receiver_of():
    made: list[Receiver] = []

    def make(case: str) -> Receiver:
        made.append(Receiver(case))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


def _request(rx: Receiver, num_tokens: int, first_dst: int) -> tuple[list[int], list[int]]:
    """(sender block ids, receiver block ids) for a sequence of ``num_tokens``, scattered."""
    n_src = rx.src_layout.blocks_for(num_tokens)
    n_dst = rx.layout.blocks_for(num_tokens)
    src = [(3 * i + 1) % NUM_BLOCKS for i in range(n_src)]
    dst = list(range(first_dst, first_dst + n_dst))[::-1]
    return src, dst


def _view(rx: Receiver) -> torch.Tensor:
    return blocks_view(rx.cache, rx.layout, rx.order, rx.wrapped)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_write_from_a_peer_of_another_layout_is_converted_on_arrival(receiver_of, case):
    rx = receiver_of(case)
    src, dst = _request(rx, 22, 5)
    before = _view(rx).clone()
    staged = rx.area.reserve(22)
    free_after_reserve = rx.area.num_free
    rx.far.call("write", "decode/staging", src, staged.staging_ids)
    assert torch.equal(_view(rx), before)  # nothing converted before finish
    staged.finish(dst)
    assert torch.equal(_view(rx), rx.expected(src, dst, 22, before))
    assert rx.area.num_free == free_after_reserve + len(staged.staging_ids) == NUM_BLOCKS


@pytest.mark.parametrize("case", ["block-4-to-16", "hnd-to-nhd", "float16-to-bfloat16",
                                  "bfloat16-hnd-4-to-float16-nhd-16"])
def test_a_layer_stream_reports_a_layer_ready_only_once_it_is_converted(receiver_of, case):
    rx = receiver_of(case)
    src, dst = _request(rx, 13, 2)
    before = _view(rx).clone()
    load = rx.area.expect("prefill", "req-1", dst, 13, timeout=30.0).start_load()
    rx.far.call("stream", "decode/staging", src, load.staging_ids, "req-1", load.epoch, b"tok")
    # The sender is done once the Final is acknowledged; the staging side may still be
    # checking the last layers' checksums (on by default).
    wait_until(lambda: all(load.stream.layers_ready()), WAIT, "the staged layers' checks")
    assert all(load.stream.layers_ready())  # landed in staging ...
    assert not any(load.layers_ready())  # ... and not reported: not converted yet
    assert torch.equal(_view(rx), before)
    expected = rx.expected(src, dst, 13, before)
    for layer in range(rx.layout.num_layers):
        load.wait_for_layer(layer, WAIT)
        assert torch.equal(_view(rx)[:layer + 1], expected[:layer + 1])
        assert torch.equal(_view(rx)[layer + 1:], before[layer + 1:])
    assert load.wait_all(WAIT) == b"tok"
    assert torch.equal(_view(rx), expected)
    assert rx.area.num_free == NUM_BLOCKS  # the staging blocks are back


# --- staging room is back-pressure --------------------------------------------------------------

def _local_area(sender_layout: kvmove.KVSpec, num_blocks: int = 4,
                cache_layout: kvmove.KVSpec | None = None) -> StagingArea:
    cache = kvmove.KVCache(cache_layout or engines.layout_for("native", block_size=16), 8)
    return StagingArea("staging", cache, sender_layout=sender_layout, num_blocks=num_blocks,
                       **TCP)


def test_no_staging_room_is_none_until_a_request_is_done():
    area = _local_area(engines.layout_for("native", block_size=4), num_blocks=4)
    try:
        first = area.reserve(12)  # 3 blocks of 4 tokens
        assert first is not None and area.num_free == 1
        assert area.reserve(5) is None  # 2 blocks: not now
        first.finish([0])
        assert area.num_free == 4 and area.reserve(5) is not None
    finally:
        area.close()


@contextlib.contextmanager
def _area_with_a_sender() -> Iterator[StagingArea]:
    """A 4-block staging area (block size 4) peered with an agent named "sender"."""
    area = _local_area(engines.layout_for("native", block_size=4), num_blocks=4)
    sender = kvmove.Agent("sender", kvmove.KVCache(area.staging.layout, 4), **TCP)
    try:
        area.agent.add_peer(sender.metadata())
        sender.add_peer(area.agent.metadata())
        yield area
    finally:
        sender.close()
        area.close()


def test_an_expect_without_room_is_none_and_a_cancelled_load_gives_its_blocks_back():
    with _area_with_a_sender() as area:
        load = area.expect("sender", "req-1", [0], 16)
        assert load is not None and area.num_free == 0
        assert area.expect("sender", "req-2", [1], 1) is None
        load.cancel()
        assert load.stream.wait_released(WAIT)
        assert area.num_free == 4


def test_a_load_dropped_unfinished_is_cancelled_and_gives_its_blocks_back():
    with _area_with_a_sender() as area:
        load = area.expect("sender", "req-1", [0], 16)
        stream = load.stream
        del load
        gc.collect()
        assert stream.state == kvmove.StreamState.FAILED
        assert stream.wait_released(WAIT)
        assert area.num_free == 4


def test_a_staged_write_finishes_once():
    area = _local_area(engines.layout_for("native", block_size=4))
    try:
        staged = area.reserve(4)
        staged.finish([0])
        with pytest.raises(ConfigError, match="finished or released"):
            staged.finish([0])
    finally:
        area.close()


def test_destination_blocks_that_do_not_hold_the_tokens_are_refused():
    area = _local_area(engines.layout_for("native", block_size=4))
    try:
        staged = area.reserve(8)
        with pytest.raises(ConfigError, match="dst_ids has 2 blocks, 8 tokens take 1 of 16"):
            staged.finish([0, 1])
        with pytest.raises(ConfigError, match="dst_ids has 0 blocks, 8 tokens take 1 of 16"):
            area.expect("x", "req", [], 8)
    finally:
        area.close()


def test_a_request_larger_than_the_whole_staging_area_is_refused():
    area = _local_area(engines.layout_for("native", block_size=4), num_blocks=4)
    try:
        with pytest.raises(ConfigError, match="17 tokens need 5 staging blocks, the staging "
                                              "area has 4"):
            area.reserve(17)
    finally:
        area.close()


def test_the_staging_agent_refuses_a_sender_of_yet_another_layout():
    area = _local_area(engines.layout_for("native", block_size=4))
    other = engines.layout_for("native", block_size=8)
    sender = kvmove.Agent("sender", kvmove.KVCache(other, 4), **TCP)
    try:
        area.agent.add_peer(sender.metadata())
        sender.add_peer(area.agent.metadata())
        with pytest.raises(ConfigError, match="KV layouts differ: block_size: 8 here, 4 at"):
            sender.write("staging", [0], [0])
    finally:
        sender.close()
        area.close()


# --- layouts that do not convert: refused before any byte moves ---------------------------------

NATIVE = engines.layout_for("native", block_size=16)
REFUSED = {
    "layers": (engines.layout_for("native", num_layers=2), "NHD",
               "num_layers: 3 here, 2 at the sender"),
    "head_dim": (kvmove.KVSpec(3, 2, 16, "float16", 4), "NHD", "head_dim: 8 here, 16 at"),
    "heads": (kvmove.KVSpec(3, 1, 8, "float16", 4), "NHD",
              "the model's KV heads: 2 here, 1 at the sender"),
    "mla": (engines.layout_for("native-mla"), "mla", "head_dim: 8 here, 24 at the sender"),
    "mla-order": (engines.layout_for("native"), "mla", "sender_order must be one of .*'mla'"),
    "vllm-cpu-into-nhd": (engines.layout_for("native", block_size=16), "vllm-cpu",
                          "vllm-cpu blocks convert only into vllm-cpu blocks of the same block "
                          "size and dtype"),
    "float8": (engines.layout_for("native", dtype="float8"), "NHD", "dtype is float8"),
    "identical": (NATIVE, "NHD", "no staging needed"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_layouts_that_do_not_convert_are_refused_naming_the_difference(case):
    sender_layout, order, message = REFUSED[case]
    cache = kvmove.KVCache(NATIVE, 4)
    with pytest.raises(ConfigError, match=message):
        StagingArea("staging", cache, sender_layout=sender_layout, sender_order=order,
                    num_blocks=4, **TCP)


def test_tensor_parallel_ranks_with_no_head_in_common_are_refused():
    rank = kvmove.KVSpec(3, 1, 8, "float16", 4)
    cache = kvmove.KVCache(rank, 4)
    with pytest.raises(ConfigError, match=r"the sender holds KV heads \[1, 2\), this cache "
                                          r"\[0, 1\): none in common"):
        StagingArea("staging", cache, sender_layout=kvmove.KVSpec(3, 1, 8, "float16", 8),
                    sender_kv_heads=(1, 2), kv_heads=(0, 2), num_blocks=4, **TCP)


def test_a_head_range_outside_the_model_is_refused():
    cache = kvmove.KVCache(engines.layout_for("native"), 4)
    with pytest.raises(ConfigError, match=r"kv_heads \(1, 2\): heads \[1, 3\) "
                                          r"\(num_kv_heads 2\) must lie in \[0, 2\)"):
        kvmove.Agent("a", cache, kv_heads=(1, 2), **TCP)


def test_an_allocated_cache_in_head_major_order_views_its_blocks_head_major():
    layout = engines.layout_for("native")
    cache = kvmove.KVCache(layout, 4, order="HND")
    assert cache.order == "HND" and cache.shape == (3, 4, 2, 2, 4, 8)
    with pytest.raises(ConfigError, match="order of an allocated cache must be one of"):
        kvmove.KVCache(layout, 4, order="mla")


# --- tensor parallelism: heads split and merged -------------------------------------------------

HEADS = 4  # the model's KV heads; a TP=2 rank holds 2


def _tp_layout(heads: int, block_size: int) -> kvmove.KVSpec:
    return kvmove.KVSpec(3, heads, 8, "float16", block_size)


def _sequence(engine: str, tensors, layout: kvmove.KVSpec, ids: list[int],
              num_tokens: int, layer: int) -> torch.Tensor:
    """[2, T, H, D] of a sender's sequence (torch reference)."""
    leaves = engines.leaves(tensors)
    return torch.cat([engines.kv_of(engine, leaves, layout, layer, i) for i in ids],
                     dim=1)[:, :num_tokens]


def _place(out: torch.Tensor, seq: torch.Tensor, dst_ids: list[int], layer: int,
           heads: slice) -> None:
    """Writes ``seq`` [2, T, h, D] into heads ``heads`` of ``out`` [L, N, 2, B, H, D]."""
    b = out.shape[3]
    for bi, block in enumerate(dst_ids):
        part = seq[:, bi * b:(bi + 1) * b]
        out[layer, block, :, :part.shape[1], heads] = part.to(out.dtype)


@pytest.fixture
def children():
    made: list[FarWrapped] = []
    yield made
    for child in made:
        child.stop()


def test_a_tp2_prefill_streams_into_a_tp1_decode_heads_merged(children):
    """Two prefill ranks (each a child process, heads [0, 2) and [2, 4), block size 4) stream
    into one decode cache of all 4 heads (block size 16, head-major): one staging area per
    rank; a layer is ready once both ranks' halves are converted."""
    rank_layout, layout = _tp_layout(2, 4), _tp_layout(HEADS, 16)
    cache = kvmove.KVCache(layout, NUM_BLOCKS, order="HND")
    cache.torch().copy_(torch.randn(cache.shape).half())
    before = cache.torch().transpose(3, 4).clone()
    areas = [StagingArea(f"decode/staging-{r}", cache, sender_layout=rank_layout,
                         sender_kv_heads=(2 * r, HEADS), num_blocks=NUM_BLOCKS, **TCP)
             for r in range(2)]
    try:
        src, dst, num_tokens = [9, 2, 5, 11, 0], [7, 3], 19
        expected, loads = before.clone(), []
        for r, area in enumerate(areas):
            far = FarWrapped(f"prefill-{r}", "flash", rank_layout, NUM_BLOCKS,
                             {**TCP, "kv_heads": (2 * r, HEADS)})
            children.append(far)
            area.agent.add_peer(far.call("metadata"))
            far.call("add_peer", area.agent.metadata())
            far.call("fill", SEED + r)
            tensors, _ = engines.make("flash", rank_layout, NUM_BLOCKS)
            engines.fill(tensors, SEED + r)
            for layer in range(3):
                seq = _sequence("flash", tensors, rank_layout, src, num_tokens, layer)
                _place(expected, seq, dst, layer, slice(2 * r, 2 * r + 2))
            loads.append(area.expect(f"prefill-{r}", "req-7", dst, num_tokens).start_load())
            far.call("stream", area.agent.name, src, loads[-1].staging_ids, "req-7",
                     loads[-1].epoch, b"")
        for layer in range(3):
            for load in loads:
                load.wait_for_layer(layer, WAIT)
            got = cache.torch().transpose(3, 4)
            assert torch.equal(got[:layer + 1], expected[:layer + 1])
            assert torch.equal(got[layer + 1:], before[layer + 1:])
        for load in loads:
            load.wait_all(WAIT)
        assert all(area.num_free == NUM_BLOCKS for area in areas)
    finally:
        for area in areas:
            area.close()


def test_a_tp1_prefill_writes_into_a_tp2_decode_heads_split(children):
    """One prefill (a child process, all 4 heads, block size 16) writes into two decode ranks,
    each an agent of its own with its cache of 2 heads (block size 4, bfloat16): rank r gets
    heads [2r, 2r + 2)."""
    layout, rank_layout = _tp_layout(HEADS, 16), kvmove.KVSpec(3, 2, 8, "bfloat16", 4)
    far = FarWrapped("prefill", "flashinfer", layout, NUM_BLOCKS, TCP)
    children.append(far)
    far.call("fill", SEED)
    tensors, _ = engines.make("flashinfer", layout, NUM_BLOCKS)
    engines.fill(tensors, SEED)
    src, dst, num_tokens = [4, 12], [1, 8, 6, 2, 14, 0, 3, 9], 29
    for r in range(2):
        cache = kvmove.KVCache(rank_layout, NUM_BLOCKS)
        cache.torch().copy_(torch.randn(cache.shape).to(torch.bfloat16))
        before = cache.torch().clone()
        area = StagingArea(f"decode-{r}/staging", cache, sender_layout=layout,
                           kv_heads=(2 * r, HEADS), num_blocks=4, **TCP)
        try:
            area.agent.add_peer(far.call("metadata"))
            far.call("add_peer", area.agent.metadata())
            staged = area.reserve(num_tokens)
            far.call("write", area.agent.name, src, staged.staging_ids)
            staged.finish(dst[:rank_layout.blocks_for(num_tokens)])
            expected = before.clone()
            for layer in range(3):
                seq = _sequence("flashinfer", tensors, layout, src, num_tokens, layer)
                _place(expected, seq[:, :, 2 * r:2 * r + 2], dst, layer, slice(0, 2))
            assert torch.equal(cache.torch(), expected)
        finally:
            area.close()


def test_the_handshake_refuses_a_sender_holding_other_heads():
    """The staging area of rank 0's heads is no identical peer for rank 1."""
    rank = _tp_layout(2, 4)
    cache = kvmove.KVCache(_tp_layout(HEADS, 16), 4)
    area = StagingArea("staging", cache, sender_layout=rank, sender_kv_heads=(0, HEADS),
                       num_blocks=4, **TCP)
    sender = kvmove.Agent("rank-1", kvmove.KVCache(rank, 4), kv_heads=(2, HEADS), **TCP)
    try:
        area.agent.add_peer(sender.metadata())
        sender.add_peer(area.agent.metadata())
        meta = kvmove._C.decode_metadata(sender.key.verify(sender.metadata()))
        assert (meta["head_first"], meta["total_kv_heads"]) == (2, HEADS)
        with pytest.raises(ConfigError, match=r"KV layouts differ: KV heads \(tensor-parallel "
                                              r"split\): \[2, 4\) of 4 here, \[0, 2\) of 4 at "
                                              r"'staging'"):
            sender.write("staging", [0], [0])
    finally:
        sender.close()
        area.close()


def test_convert_moves_only_the_heads_both_sides_hold():
    """kvmove.convert with head ranges, in one process: rank 1's heads into the upper half."""
    rank, full = _tp_layout(2, 4), _tp_layout(HEADS, 8)
    src, dst = kvmove.KVCache(rank, 4), kvmove.KVCache(full, 4)
    src.torch().copy_(torch.randn(src.shape).half())
    dst.torch().copy_(torch.randn(dst.shape).half())
    before = dst.torch().clone()
    convert(src, [0, 2], dst, [1], 7, src_heads=(2, HEADS))
    expected = before.clone()
    seq = src.torch()[:, [0, 2]].permute(0, 2, 1, 3, 4, 5).reshape(3, 2, 8, 2, 8)[:, :, :7]
    expected[:, 1, :, :7, 2:4] = seq
    assert torch.equal(dst.torch(), expected)


def test_vllm_cpu_blocks_convert_heads_as_whole_runs():
    """vLLM's CPU blocks: rank 1's heads (of a TP=2 split) into the upper half of a TP=1
    block, every position of each head's run (its order inside is vLLM's kernels'); another
    block size or order is refused."""
    rank, full = _tp_layout(2, 4), _tp_layout(HEADS, 4)
    src = kvmove.KVCache(rank, 4, order="vllm-cpu")
    dst = kvmove.KVCache(full, 4, order="vllm-cpu")
    src.torch().copy_(torch.randn(src.shape).half())
    dst.torch().copy_(torch.randn(dst.shape).half())
    before = dst.torch().clone()
    convert(src, [3, 0], dst, [1, 2], 5, src_order="vllm-cpu", dst_order="vllm-cpu",
            src_heads=(2, HEADS))
    run = lambda t: t.view(torch.uint8).reshape(3, 4, -1)  # noqa: E731 - [L, N, bytes]
    half = run(dst.torch()).shape[2] // 2
    expected = run(before.clone())
    expected[:, [1, 2], half:] = run(src.torch())[:, [3, 0]]
    assert torch.equal(run(dst.torch()), expected)
    other = kvmove.KVCache(_tp_layout(HEADS, 8), 4, order="vllm-cpu")
    with pytest.raises(ConfigError, match="block size and dtype must match, got 4 float16 "
                                          "into 8 float16"):
        convert(src, [3, 0], other, [1], 5, src_order="vllm-cpu", dst_order="vllm-cpu",
                src_heads=(2, HEADS))
    with pytest.raises(ConfigError, match="convert only into vllm-cpu blocks"):
        convert(src, [3, 0], kvmove.KVCache(full, 4), [1, 2], 5, src_order="vllm-cpu",
                src_heads=(2, HEADS))
