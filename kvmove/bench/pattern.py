"""The data pattern of ``kvmove-bench transfer``: a cache, where its blocks are placed, and a
seeded pattern on them that lets every byte be verified after any transfer (kvmove's or a
peer library's).

The pattern of (seed, layer, source block id) is one random word string XORed with a
per-(layer, block) key, so data landing in the wrong block or layer fails too. Verification
recomputes it instead of hashing both sides: it checks every byte exactly, needs no hash
library, runs at memory speed and counts the (layer, block) pairs that are wrong.
"""

from __future__ import annotations

import time

import numpy as np

from kvmove import _C
from kvmove.bench.engine_caches import allocate, block_words, native_words, wrap_engine
from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec

__all__ = ["PatternCache"]

_WIPE = np.uint64(0xA5A5A5A5A5A5A5A5)


def _base(seed: int, num_words: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**64 - 1, size=num_words, dtype=np.uint64, endpoint=True)


def _keys(seed: int, layer: int, src_ids: np.ndarray) -> np.ndarray:
    """One 64-bit key per (layer, source block): splitmix64 of (seed, layer, id)."""
    x = src_ids.astype(np.uint64) + np.uint64(((seed & 0xFFFF) << 48) | ((layer + 1) << 32))
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _cache(layout: KVSpec, num_blocks: int,
           wrap: str | None) -> tuple[KVCache, list[list[np.ndarray]], float]:
    """The cache, its ``block_words`` and the seconds ``KVCache.wrap`` took (0 for a cache
    kvmove allocates). Every page is written before anything is timed, so no page fault
    counts as registration."""
    if wrap is None:
        cache = KVCache(layout, num_blocks)
        words = native_words(cache)
        _touch(words)
        return cache, words, 0.0
    tensors = allocate(wrap, layout, num_blocks)
    words = block_words(wrap, tensors, num_blocks)
    _touch(words)
    start = time.perf_counter()
    cache = wrap_engine(wrap, tensors, layout, pool=True)
    return cache, words, time.perf_counter() - start


def _touch(words: list[list[np.ndarray]]) -> None:
    for planes in words:
        for plane in planes:
            plane.fill(0)


class PatternCache:
    """A cache of ``num_blocks`` blocks of ``layout`` and the pattern operations on them.

    Args:
        wrap: None for a ``KVCache`` kvmove allocates; else an engine of
            ``engine_caches.WRAP_FORMATS`` whose tensors (numpy) are allocated and wrapped,
            with a ``BlockPool`` so both kinds of cache place blocks alike.
        device: None for host memory; ``"cuda:N"`` for a native cache in that device's
            memory. The pattern is then written and checked in a host cache of the same
            blocks, copied to and from the device around each fill, wipe and check.

    Attributes:
        cache: the ``KVCache`` (the one an agent registers and moves).
        words: ``block_words`` of the host cache: per layer, its planes as
            ``[num_blocks, words]`` uint64.
        wrap_seconds: how long ``KVCache.wrap`` took (0 for a native cache).
    """

    def __init__(self, layout: KVSpec, num_blocks: int, wrap: str | None = None,
                 device: str | None = None) -> None:
        if layout.bytes_per_block_per_layer % 8:
            raise ConfigError(f"bytes per block per layer must be a multiple of 8, got "
                              f"{layout.bytes_per_block_per_layer}")
        if device is not None and wrap is not None:
            raise ConfigError(f"device memory ({device}) takes native caches only, got wrap "
                              f"{wrap!r} (its tensors are numpy arrays)")
        host, self.words, self.wrap_seconds = _cache(layout, num_blocks, wrap)
        self._host: KVCache | None = None
        self.cache = host
        if device is not None:
            self._host, self.cache = host, KVCache(layout, num_blocks, device=device)
        self._held: list[int] = []

    def place(self, num_blocks: int, placement: str, seed: int) -> list[int]:
        """Owns ``num_blocks`` blocks placed as ``placement`` (releasing the previous ones)."""
        pool = self.cache.pool
        assert pool is not None  # allocated, or wrapped with a pool (``_cache``)
        if self._held:
            pool.free(self._held)
        # Every block is free here (the previous ones just went back): allocate cannot refuse.
        if placement == "allocator":
            held = pool.allocate(num_blocks)
            assert held is not None
            self._held = held
        else:
            every = pool.allocate(self.cache.num_blocks)
            assert every is not None
            order = np.random.default_rng(seed).permutation(len(every))
            self._held = [every[i] for i in order[:num_blocks]]
            pool.free([every[i] for i in order[num_blocks:]])
        return list(self._held)

    def fill(self, ids: list[int], seed: int) -> None:
        ids_arr = np.asarray(ids)
        base = _base(seed, self.num_words)
        for layer, planes in enumerate(self.words):
            pattern = base ^ _keys(seed, layer, ids_arr)[:, None]
            for plane, part in zip(planes, np.split(pattern, len(planes), axis=1)):
                plane[ids_arr] = part
        self._to_device(ids)

    def wipe(self, ids: list[int]) -> None:
        ids_arr = np.asarray(ids)
        for planes in self.words:
            for plane in planes:
                plane[ids_arr] = _WIPE
        self._to_device(ids)

    def _to_device(self, ids: list[int]) -> None:
        if self._host is not None:
            _C.copy_blocks(self._host._core, ids, self.cache._core, ids)

    @property
    def num_words(self) -> int:
        """uint64 words of one block of one layer, all its planes."""
        return sum(plane.shape[1] for plane in self.words[0])

    def mismatches(self, ids: list[int], src_ids: list[int], seed: int) -> int:
        """(layer, block) pairs of ``ids`` not holding the pattern of ``src_ids`` (same order)."""
        if self._host is not None:
            _C.copy_blocks(self.cache._core, ids, self._host._core, ids)
        base, ids_arr, src_arr = _base(seed, self.num_words), np.asarray(ids), \
            np.asarray(src_ids)
        bad = 0
        for layer, planes in enumerate(self.words):
            expected = base ^ _keys(seed, layer, src_arr)[:, None]
            got = np.concatenate([plane[ids_arr] for plane in planes], axis=1)
            if not np.array_equal(got, expected):
                bad += int(np.count_nonzero((got != expected).any(axis=1)))
        return bad
