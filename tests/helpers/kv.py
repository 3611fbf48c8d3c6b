"""Bytes of a ``KVCache`` that every process computes the same way, so a receiver knows what
its blocks must hold without asking: a whole-cache ``pattern`` and per-layer ``layer_data``."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import kvmove


def make_cache(layout: dict, num_blocks: int) -> kvmove.KVCache:
    """A host ``KVCache`` of ``KVSpec(**layout)``."""
    return kvmove.KVCache(kvmove.KVSpec(**layout), num_blocks)


def pattern(seed: int, num_layers: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """Random bytes ``[L, N, block_nbytes]`` (uint8) determined by ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_layers, num_blocks, block_nbytes), dtype=np.uint8)


def raw_view(cache: Any) -> np.ndarray:
    """The cache's bytes as a writable zero-copy uint8 view ``[L, N, block_nbytes]``."""
    view = cache.numpy()
    return view.view(np.uint8).reshape(view.shape[0], view.shape[1], -1)


def fill(cache: Any, seed: int) -> np.ndarray:
    """Overwrite the whole cache with ``pattern(seed)``; returns a copy of what was written."""
    raw = raw_view(cache)
    data = pattern(seed, *raw.shape)
    raw[...] = data
    return data


def sha256(cache: Any) -> str:
    return hashlib.sha256(raw_view(cache).tobytes()).hexdigest()


def layer_data(seed: int, layer: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """Random bytes ``[num_blocks, block_nbytes]`` (uint8) for one layer of one stream."""
    rng = np.random.default_rng([seed, layer])
    return rng.integers(0, 256, size=(num_blocks, block_nbytes), dtype=np.uint8)


def write_layer(cache: Any, seed: int, layer: int, ids: list[int]) -> None:
    """Writes ``layer_data(seed, layer)`` into ``ids`` of ``layer`` ("computes" the layer)."""
    raw = raw_view(cache)
    raw[layer, ids] = layer_data(seed, layer, len(ids), raw.shape[2])


def digest_blocks(request: int, layer: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """``[num_blocks, block_nbytes]`` (uint8): block ``i`` is one 64-bit digest of (request,
    layer, i) repeated, so any block holding another request's, layer's or position's bytes,
    even in part, is caught (vLLM's read-after-reassign harness does the same)."""
    # Arrays throughout: uint64 arithmetic on arrays wraps silently (on scalars numpy warns).
    x = np.full(num_blocks, request, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x += np.uint64(layer << 32) + np.arange(num_blocks, dtype=np.uint64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    words = np.repeat(x[:, None], block_nbytes // 8, axis=1)
    return words.view(np.uint8).reshape(num_blocks, block_nbytes)
