"""Tests of ``BlockPool``, ``runs`` and ``block_hashes`` (``csrc/memory/block_pool.h``,
``csrc/memory/block_hash.h``).

Three references: hand-computed expectations for contiguity, the ``xxhash`` package for hashes,
and ``PoolModel`` below, a pure-Python statement of the pool's contract that a hypothesis state
machine drives side by side with the C++ pool. Every rejection path has its own test, which
also checks that the rejected call left the pool as it was.
"""

from __future__ import annotations

import random
import re
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvmove
from kvmove import _C, BlockPool, block_hashes
from kvmove.errors import BlockError, ConfigError

Snapshot = tuple[int, int, int, list[int], list[int | None]]


def snapshot(pool: BlockPool) -> Snapshot:
    """Everything observable about ``pool`` without changing it."""
    ids = range(pool.num_blocks)
    return (
        pool.num_free,
        pool.num_used,
        pool.num_cached,
        [pool.ref_count(i) for i in ids],
        [pool.block_hash(i) for i in ids],
    )


@contextmanager
def raises(cls: type[Exception], *mentions: object) -> Iterator[None]:
    """Expects ``cls`` whose message names every value in ``mentions`` as a whole token.

    Loose on purpose: the wording may change, the offending value and the limit may not. The
    trailing ``(file.cpp:line)`` is cut first so that a line number never passes for a value.
    """
    with pytest.raises(cls) as caught:
        yield
    message = re.sub(r"\s*\([\w./-]+:\d+\)\s*$", "", str(caught.value))
    for value in mentions:
        token = rf"(?<![\w-]){re.escape(str(value))}(?!\w)"
        assert re.search(token, message), f"{value!r} not named in {message!r}"


# A pool of 8 in every state: 0, 1 used (ref 1); 2 shared (ref 2); 3 used with hash 103;
# 4 cached with hash 104; 5, 6, 7 free.
USED, SHARED, HASHED, CACHED, FREE = 0, 2, 3, 4, 6


@pytest.fixture
def busy() -> BlockPool:
    pool = BlockPool(8)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.share([SHARED])
    pool.commit([HASHED, CACHED], [103, 104])
    pool.free([CACHED])
    hashes = [None, None, None, 103, 104, None, None, None]
    assert snapshot(pool) == (4, 4, 1, [1, 1, 2, 1, 0, 0, 0, 0], hashes)
    return pool


def full_pool(num_blocks: int) -> BlockPool:
    pool = BlockPool(num_blocks)
    assert pool.allocate(num_blocks) == list(range(num_blocks))
    return pool


# --- construction ------------------------------------------------------------------------------


def test_new_pool_is_all_free() -> None:
    pool = BlockPool(16)
    assert snapshot(pool) == (16, 0, 0, [0] * 16, [None] * 16)
    assert pool.num_blocks == 16


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_constructor_rejects_nonpositive_num_blocks(num_blocks: int) -> None:
    with raises(ConfigError, num_blocks):
        BlockPool(num_blocks)


def test_constructor_rejects_more_than_int32_blocks() -> None:
    with raises(ConfigError, 2**31):
        BlockPool(2**31)


# --- allocate ----------------------------------------------------------------------------------


def test_allocate_hands_out_blocks_with_ref_count_one() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert [pool.ref_count(i) for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (pool.num_free, pool.num_used, pool.num_cached) == (5, 3, 0)


def test_allocate_whole_pool() -> None:
    pool = BlockPool(5)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    assert (pool.num_free, pool.num_used) == (0, 5)


def test_allocate_returns_none_when_short_and_leaves_pool_unchanged(busy: BlockPool) -> None:
    before = snapshot(busy)
    assert busy.allocate(5) is None  # 3 free + 1 cached
    assert snapshot(busy) == before
    assert busy.match([104]) == [CACHED]  # the cached block was not evicted either


def test_allocate_counts_cached_blocks_as_available(busy: BlockPool) -> None:
    ids = busy.allocate(4)
    assert ids is not None and sorted(ids) == [4, 5, 6, 7]
    assert (busy.num_free, busy.num_used, busy.num_cached) == (0, 8, 0)


def test_allocate_uses_free_blocks_before_evicting_cached_ones(busy: BlockPool) -> None:
    assert busy.allocate(3) == [5, 6, 7]
    assert busy.block_hash(CACHED) == 104
    assert busy.num_cached == 1


def test_allocate_evicts_cached_block_and_drops_its_hash(busy: BlockPool) -> None:
    assert busy.allocate(3) == [5, 6, 7]
    assert busy.allocate(1) == [CACHED]
    assert busy.block_hash(CACHED) is None
    assert busy.num_cached == 0
    assert busy.match([104]) == []
    assert busy.ref_count(CACHED) == 1


def test_allocate_evicts_only_as_many_cached_blocks_as_needed() -> None:
    pool = full_pool(6)
    pool.commit([0, 1, 2, 3], [10, 11, 12, 13])
    pool.free([0, 1, 2, 3, 4])  # 4 free; 3, 2, 1, 0 cached in that eviction order
    ids = pool.allocate(3)  # 1 free + the 2 oldest cached
    assert ids is not None and sorted(ids) == [2, 3, 4]
    assert [pool.block_hash(i) for i in range(4)] == [10, 11, None, None]
    assert pool.num_cached == 2


@pytest.mark.parametrize("n", [0, -1])
def test_allocate_rejects_n_below_one(busy: BlockPool, n: int) -> None:
    before = snapshot(busy)
    with raises(ConfigError, n):
        busy.allocate(n)
    assert snapshot(busy) == before


@pytest.mark.parametrize("n", [9, 1000])
def test_allocate_rejects_n_above_num_blocks(busy: BlockPool, n: int) -> None:
    before = snapshot(busy)
    with raises(ConfigError, n, 8):
        busy.allocate(n)
    assert snapshot(busy) == before


# --- contiguity --------------------------------------------------------------------------------


def test_allocate_takes_largest_run_whole_then_best_fit() -> None:
    pool = BlockPool(16)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    assert pool.allocate(3) == [5, 6, 7]
    pool.free([0, 1, 2, 3, 4])  # free runs: [0..4], [8..15]
    ids = pool.allocate(10)  # no run holds 10: [8..15] whole, then 2 from [0..4]
    assert ids == [8, 9, 10, 11, 12, 13, 14, 15, 0, 1]
    assert kvmove.runs(ids) == [(8, 8), (0, 2)]


def test_allocate_best_fit_picks_smallest_run_that_holds_n() -> None:
    pool = full_pool(16)
    pool.free([0, 1, 2, 3, 4, 5])  # run of 6
    pool.free([8, 9, 10])  # run of 3
    pool.free([12, 13, 14, 15])  # run of 4
    assert pool.allocate(3) == [8, 9, 10]
    assert pool.allocate(4) == [12, 13, 14, 15]
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(4) == [2, 3, 4, 5]


@pytest.mark.parametrize("low_first", [True, False], ids=["low-freed-first", "high-freed-first"])
def test_allocate_best_fit_breaks_ties_by_most_recently_freed(low_first: bool) -> None:
    """Equally short runs: the run freed last wins (LIFO buckets, O(1)), whatever its ids."""
    pool = full_pool(16)
    low, high = [2, 3, 4], [11, 12, 13]
    first, last = (low, high) if low_first else (high, low)
    pool.free(first)
    pool.free(last)
    pool.free([15])
    assert pool.allocate(2) == last[:2]
    assert pool.allocate(3) == first


def test_allocate_takes_first_ids_of_the_chosen_run() -> None:
    pool = full_pool(10)
    pool.free([3, 4, 5, 6, 7, 8, 9])
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(2) == [5, 6]


def test_allocate_takes_several_largest_runs_whole() -> None:
    pool = full_pool(13)
    pool.free([0, 1])  # run of 2
    pool.free([3, 4, 5])  # run of 3
    pool.free([7, 8, 9, 10])  # run of 4
    ids = pool.allocate(8)  # 4 whole, 3 whole, then best fit 1 from the run of 2
    assert ids == [7, 8, 9, 10, 3, 4, 5, 0]
    assert kvmove.runs(ids) == [(7, 4), (3, 3), (0, 1)]


def test_free_merges_runs_with_both_neighbours() -> None:
    pool = full_pool(10)
    pool.free([2])
    pool.free([4])
    pool.free([7, 8])
    pool.free([3])  # joins [2] and [4] into [2..4]
    assert pool.allocate(3) == [2, 3, 4]  # unmerged, it would be [7, 8] plus one


def test_evicted_blocks_merge_into_free_runs() -> None:
    pool = full_pool(8)
    pool.commit([3], [33])
    pool.free([0, 1, 2])
    pool.free([3])  # cached: splits [0..2] from [4..5]
    pool.free([4, 5])
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]  # 3 evicted, one run


def free_runs(ids: set[int]) -> list[tuple[int, int]]:
    return kvmove.runs(sorted(ids))


def assert_placement(free: set[int], ids: list[int]) -> None:
    """``ids`` follow the contiguity rule over the free blocks ``free``.

    Best fit: the first ids of a shortest run that holds the rest; else a longest run whole,
    repeated. Which of several equally short (or long) runs is left open: the tie rule has its
    own test (``test_allocate_best_fit_breaks_ties_by_most_recently_freed``), so a change to it
    fails that test alone rather than every model-based check.
    """
    available, remaining = free_runs(free), len(ids)
    context = f"{ids} from free runs {available}"
    for start, count in kvmove.runs(ids):
        run = next((r for r in available if r[0] == start), None)
        assert remaining > 0 and run is not None, context
        fits = [length for _, length in available if length >= remaining]
        if fits:
            assert (run[1], count) == (min(fits), remaining), context
        else:
            assert count == run[1] == max(length for _, length in available), context
        available.remove(run)
        remaining -= count
    assert remaining == 0, context


def test_allocate_best_fit_beyond_64_blocks() -> None:
    pool = full_pool(200)
    pool.free(list(range(0, 70)))
    pool.free(list(range(71, 200)))  # runs of 70 and 129
    assert pool.allocate(65) == list(range(0, 65))
    assert pool.allocate(100) == list(range(71, 171))


def test_allocate_best_fit_beyond_4096_blocks() -> None:
    pool = full_pool(10_000)
    pool.free(list(range(0, 4100)))
    pool.free(list(range(4101, 10_000)))  # runs of 4100 and 5899
    assert pool.allocate(4097) == list(range(0, 4097))
    assert pool.allocate(5000) == list(range(4101, 9101))
    ids = pool.allocate(902)  # no run holds 902: 899 whole, then 3 of the 3 left at 4097
    assert ids == list(range(9101, 10_000)) + [4097, 4098, 4099]


@pytest.mark.parametrize("num_blocks", [130, 700, 9000])
def test_allocate_placement_in_fragmented_pool(num_blocks: int) -> None:
    """Random allocate/free; run lengths cross 64 and 4096, the free-run index's word sizes."""
    rng = random.Random(num_blocks)
    pool, free, held = BlockPool(num_blocks), set(range(num_blocks)), []
    for _ in range(300):
        if held and rng.random() < 0.5:
            ids = held.pop(rng.randrange(len(held)))
            pool.free(ids)
            free |= set(ids)
            continue
        n = rng.randint(1, max(1, num_blocks // rng.choice([2, 8, 64])))
        ids = pool.allocate(n)
        if n > len(free):
            assert ids is None
            continue
        assert ids is not None
        assert_placement(free, ids)
        free -= set(ids)
        held.append(ids)
    assert pool.num_free == len(free)


# --- free --------------------------------------------------------------------------------------


def test_free_returns_unhashed_blocks_to_free() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(4)
    pool.free(ids)
    assert snapshot(pool) == (4, 0, 0, [0] * 4, [None] * 4)
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_free_drops_one_reference_per_occurrence(busy: BlockPool) -> None:
    busy.share([USED, USED])  # ref 3
    busy.free([USED, USED])
    assert busy.ref_count(USED) == 1
    busy.free([SHARED, SHARED])
    assert busy.ref_count(SHARED) == 0
    assert (busy.num_free, busy.num_used) == (5, 3)


def test_free_caches_block_with_committed_hash(busy: BlockPool) -> None:
    busy.free([HASHED])
    assert busy.ref_count(HASHED) == 0
    assert busy.block_hash(HASHED) == 103
    assert (busy.num_free, busy.num_used, busy.num_cached) == (5, 3, 2)
    assert busy.match([103]) == [HASHED]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2, 0]])
def test_free_caches_blocks_last_in_list_evicted_first(order: list[int]) -> None:
    pool = full_pool(4)
    pool.commit([0, 1, 2], [10, 11, 12])
    pool.free(order)
    evicted = [pool.allocate(1) for _ in range(3)]
    assert evicted == [[order[2]], [order[1]], [order[0]]]


def test_cache_evicts_least_recently_freed_first() -> None:
    pool = full_pool(3)
    pool.commit([0, 1], [10, 11])
    pool.free([0])
    pool.free([1])
    assert pool.allocate(1) == [0]
    assert pool.block_hash(1) == 11


def test_match_then_free_makes_block_most_recently_used() -> None:
    pool = full_pool(3)
    pool.commit([0, 1], [10, 11])
    pool.free([0])
    pool.free([1])
    assert pool.match([10]) == [0]
    pool.free([0])  # 0 is now more recent than 1
    assert pool.allocate(1) == [1]
    assert pool.block_hash(0) == 10


@pytest.mark.parametrize("bad", [-1, 8, 2**40])
def test_free_rejects_out_of_range_id(busy: BlockPool, bad: int) -> None:
    before = snapshot(busy)
    with raises(BlockError, bad, "free"):
        busy.free([USED, SHARED, HASHED, bad, 1])
    assert snapshot(busy) == before


def test_free_rejects_free_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, FREE, "free"):
        busy.free([USED, SHARED, HASHED, FREE, 1])
    assert snapshot(busy) == before


def test_free_rejects_cached_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, CACHED, "free"):
        busy.free([HASHED, USED, CACHED])
    assert snapshot(busy) == before
    assert busy.match([104]) == [CACHED]  # still cached, not moved to the free runs


@pytest.mark.parametrize(("ids", "bad"), [([USED, USED], USED), ([SHARED] * 3, SHARED)])
def test_free_rejects_more_frees_than_references(busy: BlockPool, ids: list[int], bad: int) -> None:
    before = snapshot(busy)
    with raises(BlockError, bad, "free"):
        busy.free([HASHED, 1, *ids])
    assert snapshot(busy) == before


def test_free_rejects_double_free_across_calls() -> None:
    pool = BlockPool(8)
    pool.allocate(8)
    pool.free([5])
    before = snapshot(pool)
    with raises(BlockError, 5, "free"):
        pool.free([5])
    assert snapshot(pool) == before


# --- share -------------------------------------------------------------------------------------


def test_share_adds_one_reference_per_occurrence(busy: BlockPool) -> None:
    busy.share([USED, USED, HASHED])
    assert [busy.ref_count(i) for i in range(4)] == [3, 1, 2, 2]
    assert (busy.num_free, busy.num_used) == (4, 4)


def test_shared_block_stays_used_until_every_reference_is_freed() -> None:
    pool = BlockPool(2)
    [a, b] = pool.allocate(2)
    pool.share([a])
    pool.free([a])
    assert pool.allocate(1) is None
    pool.free([a])
    assert pool.allocate(1) == [a]


@pytest.mark.parametrize("bad", [-1, 8, 2**40])
def test_share_rejects_out_of_range_id(busy: BlockPool, bad: int) -> None:
    before = snapshot(busy)
    with raises(BlockError, bad, "share"):
        busy.share([USED, HASHED, bad])
    assert snapshot(busy) == before


def test_share_rejects_free_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, FREE, "share"):
        busy.share([USED, FREE, HASHED])
    assert snapshot(busy) == before


def test_share_rejects_cached_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, CACHED, "share"):
        busy.share([USED, SHARED, CACHED])
    assert snapshot(busy) == before


# --- commit ------------------------------------------------------------------------------------


def test_commit_tags_blocks_with_hashes() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    pool.commit([0, 2], [0, 2**64 - 1])  # the extremes of the hash range
    assert [pool.block_hash(i) for i in range(4)] == [0, None, 2**64 - 1, None]
    assert (pool.num_used, pool.num_cached) == (3, 0)


def test_commit_same_hash_again_is_a_noop(busy: BlockPool) -> None:
    before = snapshot(busy)
    busy.commit([HASHED, HASHED], [103, 103])
    assert snapshot(busy) == before


def test_commit_same_id_twice_with_one_hash_in_one_call(busy: BlockPool) -> None:
    busy.commit([USED, USED], [55, 55])
    assert busy.block_hash(USED) == 55


def test_commit_hash_held_by_used_block_leaves_second_block_untagged(busy: BlockPool) -> None:
    busy.commit([USED], [103])  # 103 belongs to HASHED
    assert busy.block_hash(USED) is None
    busy.free([USED])
    assert (busy.num_free, busy.num_cached) == (5, 1)  # back to the free runs, not cached
    assert busy.match([103]) == [HASHED]


def test_commit_hash_held_by_cached_block_keeps_cached_block(busy: BlockPool) -> None:
    busy.commit([USED], [104])  # 104 belongs to the cached block
    assert busy.block_hash(USED) is None
    busy.free([USED])
    assert (busy.num_free, busy.num_cached) == (5, 1)
    assert busy.match([104]) == [CACHED]


def test_commit_duplicate_hash_in_one_call_tags_first_block_only() -> None:
    pool = BlockPool(3)
    pool.allocate(3)
    pool.commit([1, 0], [7, 7])
    assert [pool.block_hash(i) for i in range(3)] == [None, 7, None]


def test_commit_hash_of_evicted_block_can_be_reused() -> None:
    pool = full_pool(2)
    pool.commit([0], [9])
    pool.free([0])
    assert pool.allocate(1) == [0]  # evicts 0, dropping 9
    pool.commit([1], [9])
    assert pool.block_hash(1) == 9


def test_commit_rejects_length_mismatch(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(ConfigError, 2, 1):
        busy.commit([USED, 1], [5])
    assert snapshot(busy) == before


@pytest.mark.parametrize("bad", [-1, 8, 2**40])
def test_commit_rejects_out_of_range_id(busy: BlockPool, bad: int) -> None:
    before = snapshot(busy)
    with raises(BlockError, bad, "commit"):
        busy.commit([USED, bad, 1], [50, 51, 52])
    assert snapshot(busy) == before


def test_commit_rejects_free_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, FREE, "commit"):
        busy.commit([USED, 1, FREE], [50, 51, 52])
    assert snapshot(busy) == before


def test_commit_rejects_cached_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, CACHED, "commit"):
        busy.commit([USED, CACHED], [50, 104])
    assert snapshot(busy) == before


def test_commit_rejects_different_hash_for_tagged_block(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, HASHED, 103):
        busy.commit([USED, HASHED], [50, 999])
    assert snapshot(busy) == before


def test_commit_rejects_two_hashes_for_one_id_in_one_call(busy: BlockPool) -> None:
    before = snapshot(busy)
    with raises(BlockError, USED, "commit"):
        busy.commit([USED, 1, USED], [50, 51, 52])
    assert snapshot(busy) == before


# --- match -------------------------------------------------------------------------------------


def test_match_empty_is_empty(busy: BlockPool) -> None:
    before = snapshot(busy)
    assert busy.match([]) == []
    assert snapshot(busy) == before


def test_match_miss_leaves_pool_unchanged(busy: BlockPool) -> None:
    before = snapshot(busy)
    assert busy.match([999, 104]) == []
    assert snapshot(busy) == before


def test_match_stops_at_first_miss() -> None:
    pool = BlockPool(6)
    ids = pool.allocate(4)
    pool.commit(ids, [10, 11, 12, 13])
    pool.free(ids)
    assert pool.match([10, 11, 99, 13]) == [0, 1]
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 0, 0]
    assert pool.num_cached == 2


def test_match_revives_cached_block(busy: BlockPool) -> None:
    assert busy.match([104]) == [CACHED]
    assert busy.ref_count(CACHED) == 1
    assert (busy.num_free, busy.num_used, busy.num_cached) == (3, 5, 0)
    assert busy.allocate(4) is None  # the revived block is no longer evictable


def test_match_adds_reference_to_used_committed_block(busy: BlockPool) -> None:
    assert busy.match([103, 104]) == [HASHED, CACHED]
    assert busy.ref_count(HASHED) == 2
    assert busy.ref_count(CACHED) == 1
    assert busy.num_cached == 0


def test_match_same_hash_twice_takes_two_references(busy: BlockPool) -> None:
    assert busy.match([104, 104]) == [CACHED, CACHED]
    assert busy.ref_count(CACHED) == 2
    assert (busy.num_used, busy.num_cached) == (5, 0)


# --- queries -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 8])
def test_ref_count_rejects_out_of_range_id(busy: BlockPool, bad: int) -> None:
    with raises(BlockError, bad, 8):
        busy.ref_count(bad)


@pytest.mark.parametrize("bad", [-1, 8])
def test_block_hash_rejects_out_of_range_id(busy: BlockPool, bad: int) -> None:
    with raises(BlockError, bad, 8):
        busy.block_hash(bad)


# --- runs --------------------------------------------------------------------------------------

RUNS_CASES = [
    ([4, 5, 6, 9, 2, 3], [(4, 3), (9, 1), (2, 2)]),
    ([], []),
    ([7], [(7, 1)]),
    ([0, 1, 2, 3], [(0, 4)]),
    ([3, 2, 1], [(3, 1), (2, 1), (1, 1)]),
    ([1, 3, 5], [(1, 1), (3, 1), (5, 1)]),
]


@pytest.mark.parametrize(("ids", "expected"), RUNS_CASES)
def test_runs_groups_consecutive_ascending_ids(
    ids: list[int], expected: list[tuple[int, int]]
) -> None:
    assert kvmove.runs(ids) == expected


# --- block_hashes ------------------------------------------------------------------------------


def reference_block_hashes(
    tokens: list[int], block_size: int, parent: int | None = None
) -> list[int]:
    """The chained XXH64 of every full block, computed with the ``xxhash`` package."""
    out: list[int] = []
    prev = 0 if parent is None else parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = struct.pack(f"<Q{block_size}q", prev, *tokens[start : start + block_size])
        prev = xxhash.xxh64(data, seed=0).intdigest()
        out.append(prev)
    return out


def random_tokens(num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 152_064) for _ in range(num_tokens)]


@pytest.mark.parametrize("block_size", [1, 3, 16, 1024])
@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 17, 48, 100, 5000])
def test_block_hashes_match_reference(num_tokens: int, block_size: int) -> None:
    tokens = random_tokens(num_tokens)
    got = block_hashes(tokens, block_size)
    assert len(got) == num_tokens // block_size
    assert got == reference_block_hashes(tokens, block_size)


def test_block_hashes_extreme_token_values() -> None:
    tokens = [0, -1, 2**63 - 1, -(2**63), 1, 2**31, -(2**31), 42]
    assert block_hashes(tokens, 4) == reference_block_hashes(tokens, 4)


@pytest.mark.parametrize("parent", [0, 1, 2**64 - 1, 0x9E3779B185EBCA87])
def test_block_hashes_parent_seeds_first_block(parent: int) -> None:
    tokens = random_tokens(40)
    assert block_hashes(tokens, 8, parent=parent) == reference_block_hashes(tokens, 8, parent)


def test_block_hashes_none_parent_equals_zero() -> None:
    tokens = random_tokens(32)
    assert block_hashes(tokens, 16) == block_hashes(tokens, 16, parent=0)
    assert block_hashes(tokens, 16, None) == block_hashes(tokens, 16, 0)


def test_block_hashes_chain_continues_from_parent() -> None:
    tokens = random_tokens(48)
    head = block_hashes(tokens[:32], 16)
    tail = block_hashes(tokens[32:48], 16, parent=head[1])
    assert head + tail == block_hashes(tokens[:48], 16)


def test_block_hashes_equal_prefixes_give_equal_hashes() -> None:
    a = random_tokens(64, seed=1)
    b = a[:40] + random_tokens(24, seed=2)  # differs from token 40 (block 2 of 16)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]


def test_block_hashes_change_in_first_token_changes_every_hash() -> None:
    a = random_tokens(64)
    b = [a[0] + 1, *a[1:]]
    assert all(x != y for x, y in zip(block_hashes(a, 8), block_hashes(b, 8), strict=True))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_block_hashes_numpy_equals_list(dtype: type) -> None:
    tokens = random_tokens(70)
    assert block_hashes(np.array(tokens, dtype=dtype), 16) == block_hashes(tokens, 16)


@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    block_size=st.integers(1, 9),
    parent=st.none() | st.integers(0, 2**64 - 1),
)
@settings(max_examples=150, deadline=None)
def test_block_hashes_match_reference_random(
    tokens: list[int], block_size: int, parent: int | None
) -> None:
    expected = reference_block_hashes(tokens, block_size, parent)
    assert block_hashes(tokens, block_size, parent) == expected


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_hashes_rejects_nonpositive_block_size(block_size: int) -> None:
    with raises(ConfigError, block_size):
        block_hashes([1, 2, 3, 4], block_size)


def test_block_hashes_rejects_2d_tokens() -> None:
    with pytest.raises(ValueError):
        block_hashes(np.zeros((2, 16), dtype=np.int64), 16)


def test_xxh64_matches_reference_at_every_length() -> None:
    data = bytes(random.Random(3).randrange(256) for _ in range(200))
    for seed in (0, 1, 2**64 - 1):
        for n in range(201):
            expected = xxhash.xxh64(data[:n], seed=seed).intdigest()
            assert _C.xxh64(data[:n], seed) == expected, (n, seed)


@given(data=st.binary(max_size=200), seed=st.integers(0, 2**64 - 1))
@settings(max_examples=300, deadline=None)
def test_xxh64_matches_reference_random(data: bytes, seed: int) -> None:
    assert _C.xxh64(data, seed) == xxhash.xxh64(data, seed=seed).intdigest()


def test_xxh3_matches_reference_at_every_length() -> None:
    # Past 240 bytes XXH3 switches to its long-input loop (stripes, then blocks of 1 KiB).
    data = bytes(random.Random(4).randrange(256) for _ in range(3000))
    for seed in (0, 1, 2**64 - 1):
        for n in [*range(260), 1023, 1024, 1025, 2047, 2048, 2049, 3000]:
            expected = xxhash.xxh3_64(data[:n], seed=seed).intdigest()
            assert _C.xxh3(data[:n], seed) == expected, (n, seed)


def test_block_checksums_are_xxh3_of_a_block_in_layer_order() -> None:
    """A storage tier's checksum of a block: XXH3 of every layer's K and V, layer after layer,
    seeded (the disk tier's slot holds exactly those bytes)."""
    layout = kvmove.KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32",
                           block_size=4)
    cache = kvmove.KVCache(layout, 5)
    cache.numpy()[...] = np.random.default_rng(0).random(cache.shape, dtype=np.float32)
    seeds = [7, 2**64 - 1, 0]
    got = _C.block_checksums(cache._core, [4, 0, 2], seeds)
    for block, seed, value in zip([4, 0, 2], seeds, got):
        data = np.ascontiguousarray(cache.numpy()[:, block]).tobytes()
        assert value == xxhash.xxh3_64(data, seed=seed).intdigest()
    with pytest.raises(BlockError, match="block id 5 out of range"):
        _C.block_checksums(cache._core, [5], [0])
    with pytest.raises(ConfigError, match="one seed per block id"):
        _C.block_checksums(cache._core, [0, 1], [0])


# --- threads -----------------------------------------------------------------------------------

NUM_THREADS = 8


class Owners:
    """Which thread holds each block; fails the moment two threads hold the same one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner: dict[int, int] = {}

    def take(self, ids: list[int], thread: int) -> None:
        with self.lock:
            clash = {i: self.owner[i] for i in ids if i in self.owner}
            assert not clash, f"thread {thread} got blocks held by {clash}"
            assert len(set(ids)) == len(ids), f"duplicate ids {ids}"
            self.owner.update(dict.fromkeys(ids, thread))

    def give(self, ids: list[int], thread: int) -> None:
        """Called before the blocks are freed, so nobody can have them yet."""
        with self.lock:
            for i in ids:
                assert self.owner.pop(i) == thread


def run_threads(worker: Callable[[int], None], num_threads: int = NUM_THREADS) -> None:
    barrier = threading.Barrier(num_threads)

    def start(thread: int) -> None:
        barrier.wait()
        worker(thread)

    with ThreadPoolExecutor(num_threads) as pool:
        for future in [pool.submit(start, t) for t in range(num_threads)]:
            future.result()


def assert_all_free(pool: BlockPool) -> None:
    n = pool.num_blocks
    assert (pool.num_free, pool.num_used) == (n, 0)
    assert [pool.ref_count(i) for i in range(n)] == [0] * n
    assert pool.allocate(n) == list(range(n))  # the free runs merged back into one


def test_threads_allocate_share_free_never_share_a_block() -> None:
    pool, owners = BlockPool(64), Owners()

    def worker(thread: int) -> None:
        rng = random.Random(thread)
        held: list[tuple[list[int], int]] = []  # (ids, references per id)
        for _ in range(3000):
            if held and rng.random() < 0.5:
                ids, refs = held.pop(rng.randrange(len(held)))
                owners.give(ids, thread)
                pool.free(ids * refs)
            elif (ids := pool.allocate(rng.randint(1, 8))) is not None:
                owners.take(ids, thread)
                refs = rng.randint(1, 3)
                for _ in range(refs - 1):
                    pool.share(ids)
                held.append((ids, refs))
        for ids, refs in held:
            owners.give(ids, thread)
            pool.free(ids * refs)

    run_threads(worker)
    assert owners.owner == {}
    assert pool.num_cached == 0
    assert_all_free(pool)


def test_threads_commit_match_never_share_a_block() -> None:
    pool, owners = BlockPool(48), Owners()

    def worker(thread: int) -> None:
        rng = random.Random(100 + thread)
        for _ in range(800):
            chain = [(thread << 32) | k for k in range(rng.randint(1, 6))]  # this thread's only
            ids = pool.allocate(len(chain))
            if ids is not None:
                owners.take(ids, thread)
                pool.commit(ids, chain)
                owners.give(ids, thread)
                pool.free(ids)
            matched = pool.match(chain)
            owners.take(matched, thread)
            owners.give(matched, thread)
            pool.free(matched)

    run_threads(worker)
    assert pool.num_cached <= pool.num_blocks
    assert_all_free(pool)


# --- model-based -------------------------------------------------------------------------------


class PoolModel:
    """The BlockPool contract in plain Python, except which ids allocate() picks."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.lru: list[int] = []  # cached blocks, least recently used first

    def free_ids(self) -> set[int]:
        return {i for i in range(self.num_blocks) if self.ref[i] == 0 and self.hash[i] is None}

    def used_ids(self) -> list[int]:
        return [i for i in range(self.num_blocks) if self.ref[i] > 0]

    def tagged_used_ids(self) -> list[int]:
        return [i for i in self.used_ids() if self.hash[i] is not None]

    def unused_ids(self) -> list[int]:
        return [i for i in range(self.num_blocks) if self.ref[i] == 0]

    def holder(self, h: int) -> int | None:
        return next((i for i, mine in enumerate(self.hash) if mine == h), None)

    def evictions_for(self, n: int) -> list[int] | None:
        """The cached blocks allocate(n) must evict, or None for back-pressure."""
        num_free = len(self.free_ids())
        if n > num_free + len(self.lru):
            return None
        return self.lru[: max(0, n - num_free)]

    def allocate(self, ids: list[int], evicted: list[int]) -> None:
        for i in evicted:
            self.lru.remove(i)
            self.hash[i] = None
        for i in ids:
            self.ref[i] = 1

    def free(self, ids: list[int]) -> None:
        for i in reversed(ids):
            self.ref[i] -= 1
            if self.ref[i] == 0 and self.hash[i] is not None:
                self.lru.append(i)

    def share(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] += 1

    def commit_is_valid(self, ids: list[int], hashes: list[int]) -> bool:
        first: dict[int, int] = {}
        for i, h in zip(ids, hashes, strict=True):
            expected = self.hash[i] if self.hash[i] is not None else first.setdefault(i, h)
            if h != expected:
                return False
        return True

    def commit(self, ids: list[int], hashes: list[int]) -> None:
        for i, h in zip(ids, hashes, strict=True):
            if self.hash[i] is None and self.holder(h) is None:
                self.hash[i] = h

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            i = self.holder(h)
            if i is None:
                break
            if self.ref[i] == 0:
                self.lru.remove(i)
            self.ref[i] += 1
            out.append(i)
        return out


HASHES = st.sampled_from([0, 1, 2, 3, 4, 2**64 - 1])


class PoolMachine(RuleBasedStateMachine):
    """Random call sequences on a real pool and on PoolModel; they must never disagree."""

    pool: BlockPool
    model: PoolModel

    @initialize(num_blocks=st.integers(1, 12))
    def create(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.model = PoolModel(num_blocks)

    def references(self, data: st.DataObject, *, exclude: int | None = None) -> list[int]:
        """Some of the held references (each id at most ref_count times), in random order."""
        held = [i for i in self.model.used_ids() if i != exclude for _ in range(self.model.ref[i])]
        shuffled = data.draw(st.permutations(held), label="held")
        return shuffled[: data.draw(st.integers(0, len(held)), label="how many")]

    def out_of_range(self, data: st.DataObject) -> int:
        n = self.model.num_blocks
        return data.draw(st.sampled_from([-1, -(2**40), n, n + 5]), label="bad id")

    def with_bad(self, data: st.DataObject, ids: list[int], bad: int) -> list[int]:
        at = data.draw(st.integers(0, len(ids)), label="bad at")
        return [*ids[:at], bad, *ids[at:]]

    # valid calls

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, self.model.num_blocks), label="n")
        evicted = self.model.evictions_for(n)
        free_before = self.model.free_ids() | set(evicted or [])
        ids = self.pool.allocate(n)
        if evicted is None:
            assert ids is None
            return
        assert ids is not None and len(ids) == n and len(set(ids)) == n
        assert set(ids) <= free_before
        assert_placement(free_before, ids)
        for i in evicted:
            assert self.pool.block_hash(i) is None
        self.model.allocate(ids, evicted)

    @precondition(lambda self: self.model.used_ids())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = self.references(data)
        self.pool.free(ids)
        self.model.free(ids)

    @precondition(lambda self: self.model.used_ids())
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.model.used_ids()), max_size=4), label="ids")
        self.pool.share(ids)
        self.model.share(ids)

    @precondition(lambda self: self.model.used_ids())
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.model.used_ids()), max_size=4), label="ids")
        hashes = data.draw(st.lists(HASHES, min_size=len(ids), max_size=len(ids)), label="hashes")
        if not self.model.commit_is_valid(ids, hashes):
            with pytest.raises(BlockError):
                self.pool.commit(ids, hashes)
            return
        self.pool.commit(ids, hashes)
        self.model.commit(ids, hashes)

    @rule(hashes=st.lists(HASHES, max_size=4))
    def match(self, hashes: list[int]) -> None:
        assert self.pool.match(hashes) == self.model.match(hashes)

    # rejected calls: the invariants check that the pool still equals the unchanged model

    @rule(data=st.data())
    def allocate_bad_n(self, data: st.DataObject) -> None:
        n = data.draw(st.sampled_from([0, -1, self.model.num_blocks + 1]), label="bad n")
        with raises(ConfigError, n):
            self.pool.allocate(n)

    @precondition(lambda self: self.model.unused_ids())
    @rule(data=st.data())
    def free_unallocated(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(self.model.unused_ids()), label="bad id")
        with raises(BlockError, bad):
            self.pool.free(self.with_bad(data, self.references(data), bad))

    @precondition(lambda self: self.model.used_ids())
    @rule(data=st.data())
    def free_too_often(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(self.model.used_ids()), label="bad id")
        ids = self.references(data, exclude=bad) + [bad] * (self.model.ref[bad] + 1)
        with raises(BlockError, bad):
            self.pool.free(data.draw(st.permutations(ids), label="ids"))

    @rule(data=st.data())
    def free_out_of_range(self, data: st.DataObject) -> None:
        bad = self.out_of_range(data)
        with raises(BlockError, bad):
            self.pool.free(self.with_bad(data, self.references(data), bad))

    @precondition(lambda self: self.model.unused_ids())
    @rule(data=st.data())
    def share_unallocated(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(self.model.unused_ids()), label="bad id")
        with raises(BlockError, bad):
            self.pool.share(self.with_bad(data, self.model.used_ids(), bad))

    @rule(data=st.data())
    def share_out_of_range(self, data: st.DataObject) -> None:
        bad = self.out_of_range(data)
        with raises(BlockError, bad):
            self.pool.share(self.with_bad(data, self.model.used_ids(), bad))

    def valid_commit(self, data: st.DataObject) -> tuple[list[int], list[int]]:
        """Distinct used ids with hashes a commit would accept (and apply)."""
        used = self.model.used_ids()
        ids = data.draw(st.lists(st.sampled_from(used), unique=True), label="ids") if used else []
        own = [self.model.hash[i] for i in ids]
        return ids, [data.draw(HASHES) if h is None else h for h in own]

    @precondition(lambda self: self.model.unused_ids())
    @rule(data=st.data())
    def commit_unallocated(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(self.model.unused_ids()), label="bad id")
        ids, hashes = self.valid_commit(data)
        with raises(BlockError, bad):
            self.pool.commit([*ids, bad], [*hashes, data.draw(HASHES)])

    @precondition(lambda self: self.model.tagged_used_ids())
    @rule(data=st.data())
    def commit_other_hash(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(self.model.tagged_used_ids()), label="bad id")
        other = data.draw(HASHES.filter(lambda h: h != self.model.hash[bad]), label="other hash")
        ids, hashes = self.valid_commit(data)
        with raises(BlockError, bad):
            self.pool.commit([*ids, bad], [*hashes, other])

    @precondition(lambda self: self.model.used_ids())
    @rule(data=st.data(), extra=st.sampled_from([-1, 1]))
    def commit_length_mismatch(self, data: st.DataObject, extra: int) -> None:
        ids, hashes = self.valid_commit(data)
        hashes = hashes[:-1] if extra < 0 and hashes else [*hashes, 0]
        with pytest.raises(ConfigError):
            self.pool.commit(ids, hashes)

    @invariant()
    def counts_agree(self) -> None:
        model = self.model
        num_free = len(model.free_ids()) + len(model.lru)
        assert (self.pool.num_free, self.pool.num_used, self.pool.num_cached) == (
            num_free,
            model.num_blocks - num_free,
            len(model.lru),
        )

    @invariant()
    def blocks_agree(self) -> None:
        ids = range(self.model.num_blocks)
        assert [self.pool.ref_count(i) for i in ids] == self.model.ref
        assert [self.pool.block_hash(i) for i in ids] == self.model.hash


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
