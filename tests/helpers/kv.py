"""Bytes of a ``KVCache`` that every process computes the same way, so a receiver knows what
its blocks must hold without asking: a whole-cache ``pattern`` and per-layer ``layer_data``."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import kvmove


def make_cache(layout: dict, num_blocks: int) -> kvmove.KVCache:
    """A host ``KVCache`` of ``KVLayout(**layout)``."""
    return kvmove.KVCache(kvmove.KVLayout(**layout), num_blocks)


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
