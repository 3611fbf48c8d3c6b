"""KVStore tiers on this machine: one Llama-3.1-8B 4,000-token KV (524 MB) written to and read
back from the host tier and the disk tier (O_DIRECT where the file system allows).

Run: ``pytest bench/test_bench_store.py`` (add ``--benchmark-json out.json`` for a file);
``kvmove-bench store`` measures the same rows against dd and a plain file, and the TTFT of a
repeated prompt. Every round stores the blocks under new hashes, so every put writes.
``extra_info``: GB/s and its ratio to ``memcpy`` of the same bytes, measured in the fixture
(this run). No row asserts a speed.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvmove import DiskTier, HostTier, KVCache, KVSpec, KVStore

LAYOUT = KVSpec.preset("llama-3.1-8b")
NUM_BLOCKS = LAYOUT.blocks_for(4000)
NBYTES = NUM_BLOCKS * LAYOUT.bytes_per_block
IDS = list(range(NUM_BLOCKS))
ROUNDS = 3
WAIT = 600.0


@pytest.fixture(scope="module")
def caches() -> tuple[KVCache, KVCache]:
    src, dst = KVCache(LAYOUT, NUM_BLOCKS), KVCache(LAYOUT, NUM_BLOCKS)
    raw = np.asarray(src.region)
    raw[:] = np.resize(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8),
                       raw.size)
    return src, dst


@pytest.fixture(scope="module")
def memcpy_seconds(caches: tuple[KVCache, KVCache]) -> float:
    src, dst = (np.asarray(c.region) for c in caches)
    times = []
    for _ in range(ROUNDS + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@pytest.fixture(params=["host", "disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    tier = HostTier(NBYTES) if request.param == "host" else DiskTier(tmp_path, NBYTES)
    with KVStore(LAYOUT, [tier]) as s:
        yield s


_generation = itertools.count(1)


def _put(store: KVStore, src: KVCache) -> list[int]:
    hashes = [(next(_generation) << 32) + i for i in IDS]
    assert store.put(hashes, src, IDS).wait(WAIT) == NUM_BLOCKS
    return hashes


def _extra(benchmark, memcpy_seconds: float) -> None:
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update({"gbps": NBYTES / seconds / 1e9,
                                 "vs_memcpy": memcpy_seconds / seconds})


def test_put(benchmark, store: KVStore, caches: tuple[KVCache, KVCache],
             memcpy_seconds: float) -> None:
    benchmark.group = "store put (524 MB)"
    benchmark.pedantic(_put, args=(store, caches[0]), rounds=ROUNDS, warmup_rounds=1)
    _extra(benchmark, memcpy_seconds)


def test_get(benchmark, store: KVStore, caches: tuple[KVCache, KVCache],
             memcpy_seconds: float) -> None:
    benchmark.group = "store get (524 MB)"
    src, dst = caches
    hashes = _put(store, src)
    benchmark.pedantic(lambda: store.get(hashes, dst, IDS).wait(WAIT), rounds=ROUNDS,
                       warmup_rounds=1)
    assert np.array_equal(np.asarray(dst.region), np.asarray(src.region))
    _extra(benchmark, memcpy_seconds)
