"""BlockPool allocate+free throughput against a pure-Python free list, same run, same machine.

Run: ``pytest bench/test_bench_block_pool.py`` (pytest-benchmark prints each row's mean and,
in parentheses, its ratio to the fastest row of the group: the baseline's ratio is the
speed-up). Add ``--benchmark-json out.json`` for a file.

Two baselines, both written here in plain Python:

* ``PyFreeList``: the same contract as ``kvmove.BlockPool`` for allocate/free (validated
  ``n``, all-or-nothing, reference counts, range and double-free checks that change nothing
  on failure, hashed blocks kept as cached) over a LIFO free list, i.e. what an engine would
  write instead of using kvmove, minus contiguity and eviction.
* ``BareFreeList``: a list pop/extend and a ref-count array with no checks at all: the floor
  of any pure-Python allocator, for perspective.
"""

from __future__ import annotations

import pytest

import kvmove

NUM_BLOCKS = 4096
BATCH = 256


class PyFreeList:
    """Pure-Python free list with BlockPool's allocate/free contract (no contiguity)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self.ref_count = [0] * num_blocks
        self.hashed = [False] * num_blocks
        self.cached: dict[int, None] = {}  # insertion-ordered: an LRU

    def allocate(self, n: int) -> list[int] | None:
        if n < 1 or n > self.num_blocks:
            raise ValueError(f"cannot allocate {n} blocks: the pool has {self.num_blocks}")
        if n > len(self.free_ids) + len(self.cached):
            return None
        ids = self.free_ids[-n:]
        del self.free_ids[-n:]
        for i in ids:
            self.ref_count[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        ref = self.ref_count
        for pos, i in enumerate(ids):
            if not 0 <= i < self.num_blocks or ref[i] == 0:
                for j in ids[:pos]:
                    ref[j] += 1
                raise ValueError(f"cannot free block {i}")
            ref[i] -= 1
        for i in reversed(ids):
            if ref[i] == 0:
                if self.hashed[i]:
                    self.cached[i] = None
                else:
                    self.free_ids.append(i)


class BareFreeList:
    """No checks: the fastest a Python allocator can be."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks))
        self.ref_count = [0] * num_blocks

    def allocate(self, n: int) -> list[int]:
        ids = self.free_ids[-n:]
        del self.free_ids[-n:]
        for i in ids:
            self.ref_count[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            self.ref_count[i] -= 1
        self.free_ids.extend(ids)


def allocate_free(pool) -> None:
    ids = pool.allocate(BATCH)
    pool.free(ids)


@pytest.mark.benchmark(group=f"allocate+free {BATCH} blocks of {NUM_BLOCKS}")
@pytest.mark.parametrize(
    "make_pool",
    [kvmove.BlockPool, PyFreeList, BareFreeList],
    ids=["kvmove.BlockPool", "PyFreeList (same contract)", "BareFreeList (no checks)"],
)
def test_allocate_free(benchmark, make_pool):
    pool = make_pool(NUM_BLOCKS)
    benchmark(allocate_free, pool)
    assert pool.allocate(NUM_BLOCKS) is not None  # everything came back


@pytest.mark.benchmark(group=f"allocate+free {BATCH} blocks, fragmented pool")
@pytest.mark.parametrize("make_pool", [kvmove.BlockPool, PyFreeList],
                         ids=["kvmove.BlockPool", "PyFreeList (same contract)"])
def test_allocate_free_fragmented(benchmark, make_pool):
    """Every other block held, so no run is longer than one block: the allocator's worst case."""
    pool = make_pool(NUM_BLOCKS)
    held = pool.allocate(NUM_BLOCKS)
    pool.free(held[::2])
    benchmark(allocate_free, pool)
