"""A ``KVStore`` of opaque byte chunks, keyed by strings: what LMCache's objects need.

LMCache hands its storage layer objects that are byte buffers of (at most) one chunk, keyed
by its own key types. A ``KVStore`` keeps blocks of a ``KVSpec`` layout, keyed by 64-bit
block hashes. This file bridges the two without LMCache (``kvmove.integrations.lmcache``
adapts LMCache's interfaces to it):

- **One block is one record**: a one-layer MLA layout of 1-token blocks, 1-byte elements and
  a latent as wide as the record (``record_layout``), so a block is exactly
  ``HEADER_NBYTES + max_nbytes`` bytes and the store's tiers, LRU and checksums apply as is::

      block | length: u64 LE | key check: 16 B | payload: length B | zeros to max_nbytes |

- **Keys** are strings (the caller's canonical spelling of its key). BLAKE2b-192 of the
  string gives the block hash (its first 8 bytes) and the key check (the other 16). Two keys
  whose 64-bit hashes collide (about 1 in 10^8 among 10^6 stored chunks, the birthday bound
  n^2 / 2^65) cost a miss, never the other key's bytes: a get compares the key check stored
  in the block. The store verifies each block's checksum (XXH3, seeded with its hash) on
  every read, so damaged bytes are a miss too.
- **A staging cache** of ``staging_blocks`` blocks carries records between the caller's
  buffers and the store: one copy each way. We do not wrap LMCache's memory zero-copy
  (``KVCache.wrap``): a wrapped cache's blocks lie at one fixed stride, and LMCache's
  allocator places objects anywhere in its arena at its own alignment (1 B in
  ``lmcache bench l2``).
- **A full store is back-pressure**: the tiers evict least recently used blocks (host to
  disk, disk out); ``put`` reports what it kept and never raises for lack of room.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec
from kvmove.store import DiskTier, HostTier, KVStore

__all__ = ["HEADER_NBYTES", "ChunkStore", "ChunkStoreConfig", "key_digest", "record_layout"]

logger = logging.getLogger(__name__)

HEADER_NBYTES = 24  # u64 payload length + 16 B key check
_GIB = 1 << 30
_TIMEOUT_S = 120.0  # a store operation still running after this is a failed operation


@dataclass(frozen=True, slots=True)
class ChunkStoreConfig:
    """Where chunks are kept: host memory and/or a disk directory (capacities in bytes).

    Args:
        host_nbytes: host tier capacity; 0 for none.
        disk_path: disk tier directory (its own, e.g. ``/mnt/nvme/lmcache-kvmove``); None for
            none.
        disk_nbytes: disk tier capacity; needed with ``disk_path``.
        staging_blocks: records copied per store operation (the staging cache's size).
        names: how the caller spells each field in its own configuration, for error messages.
    """

    host_nbytes: int = _GIB
    disk_path: str | None = None
    disk_nbytes: int = 0
    staging_blocks: int = 64
    names: tuple[str, str, str, str] = ("host_nbytes", "disk_path", "disk_nbytes",
                                        "staging_blocks")

    def __post_init__(self) -> None:
        host, path, disk, staging = self.names
        _require_int(host, self.host_nbytes, minimum=0)
        _require_int(staging, self.staging_blocks, minimum=1)
        if self.disk_path is not None and (not isinstance(self.disk_path, str)
                                           or not self.disk_path):
            raise ConfigError(f"{path} must be a non-empty directory path, got "
                              f"{self.disk_path!r}")
        if self.disk_path is not None:
            _require_int(disk, self.disk_nbytes, minimum=1)
        if self.host_nbytes == 0 and self.disk_path is None:
            raise ConfigError(f"no tier: {host} is 0 and {path} is not set")

    @classmethod
    def from_gb(cls, values: dict[str, object], names: tuple[str, str, str, str]
                ) -> ChunkStoreConfig:
        """From a caller's config with capacities in GB (GiB, LMCache's unit): ``values`` maps
        each of ``names`` (host GB, disk path, disk GB, staging blocks) to its value or None
        (absent: the default)."""
        host, path, disk, staging = (values.get(n) for n in names)
        return cls(host_nbytes=_gb_to_nbytes(names[0], 1 if host is None else host),
                   disk_path=None if path is None else str(path),
                   disk_nbytes=0 if disk is None else _gb_to_nbytes(names[2], disk),
                   staging_blocks=64 if staging is None else _to_int(names[3], staging),
                   names=names)

    def tiers(self) -> list[HostTier | DiskTier]:
        tiers: list[HostTier | DiskTier] = []
        if self.host_nbytes:
            tiers.append(HostTier(self.host_nbytes))
        if self.disk_path is not None:
            tiers.append(DiskTier(os.path.expanduser(self.disk_path), self.disk_nbytes))
        return tiers


def record_layout(max_nbytes: int) -> KVSpec:
    """The layout whose one block holds one record of up to ``max_nbytes`` payload bytes:
    1 layer, 1-token blocks, a 1-byte latent of ``HEADER_NBYTES + max_nbytes`` elements."""
    _require_int("max_nbytes", max_nbytes, minimum=1)
    return KVSpec(num_layers=1, num_kv_heads=1, head_dim=HEADER_NBYTES + max_nbytes,
                  dtype="float8", block_size=1, mla=True)


def key_digest(key: str) -> tuple[int, bytes]:
    """``(block hash, key check)`` of a key's canonical string: BLAKE2b-192, split 8 + 16."""
    digest = hashlib.blake2b(key.encode(), digest_size=24).digest()
    return int.from_bytes(digest[:8], "little"), digest[8:]


class ChunkStore:
    """Records of up to ``max_nbytes`` bytes in a ``KVStore``; thread-safe (one lock).

    Args:
        config: the tiers.
        max_nbytes: the largest payload a record holds (LMCache's chunk, with its header).
        namespace: the store's namespace (what else makes equal keys mean equal bytes).

    Raises:
        ConfigError: a capacity under one block.
        StoreError: a disk directory that cannot be used (another layout, another user's).
    """

    def __init__(self, config: ChunkStoreConfig, max_nbytes: int, namespace: str) -> None:
        self.max_nbytes = max_nbytes
        self.block_nbytes = HEADER_NBYTES + max_nbytes
        layout = record_layout(max_nbytes)
        self.store = KVStore(layout, config.tiers(), namespace=namespace, load_policy="always")
        self._staging = KVCache(layout, num_blocks=config.staging_blocks)
        assert self._staging.region is not None  # kvmove allocated it
        self._rows = np.asarray(self._staging.region).reshape(config.staging_blocks, -1)
        self._lock = threading.Lock()

    def put(self, keys: Sequence[str], payloads: Sequence[np.ndarray]) -> list[bool]:
        """Stores each payload (uint8, 1-D) under its key; per key, whether the store took it
        (it may evict it later to make room for others). A payload over ``max_nbytes`` is not
        stored (False), nor raised."""
        held: list[bool] = []
        with self._lock:
            for start in range(0, len(keys), len(self._rows)):
                end = start + len(self._rows)
                held += self._put_batch(keys[start:end], payloads[start:end])
        return held

    def _put_batch(self, keys: Sequence[str], payloads: Sequence[np.ndarray]) -> list[bool]:
        hashes: list[int | None] = []
        for row, (key, payload) in enumerate(zip(keys, payloads)):
            if payload.nbytes > self.max_nbytes:
                logger.warning("chunk of %d bytes not stored: records hold up to %d",
                               payload.nbytes, self.max_nbytes)
                hashes.append(None)
                continue
            block_hash, check = key_digest(key)
            self._fill(row, payload, check)
            hashes.append(block_hash)
        rows = [i for i, h in enumerate(hashes) if h is not None]
        todo = [h for h in hashes if h is not None]
        held = self.store.put(todo, self._staging, rows).wait(_TIMEOUT_S) if todo else 0
        if held == len(todo):
            return [h is not None for h in hashes]
        return [h is not None and self._stored(h) for h in hashes]  # full: some went out

    def _fill(self, row: int, payload: np.ndarray, check: bytes) -> None:
        dest = self._rows[row]
        dest[:8] = np.frombuffer(payload.nbytes.to_bytes(8, "little"), np.uint8)
        dest[8:HEADER_NBYTES] = np.frombuffer(check, np.uint8)
        end = HEADER_NBYTES + payload.nbytes
        dest[HEADER_NBYTES:end] = payload
        dest[end:] = 0  # equal records give equal blocks (and checksums)

    def _stored(self, block_hash: int) -> bool:
        return bool(int(self.store.lookup([block_hash])))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a record is stored under its block hash (a lookup: it counts as
        use for the LRU). A 64-bit collision answers True here and misses in ``get``."""
        return [self._stored(key_digest(k)[0]) for k in keys]

    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray | None]
            ) -> list[np.ndarray | None]:
        """Per key, its payload, or None where it did not arrive: missing, corrupt (checksum),
        another key's (key check) or, with an ``out`` (writable uint8, 1-D), not exactly
        ``out.nbytes`` long. With an ``out`` the payload is copied into it and ``out`` is
        returned; without, a copy of its own."""
        found: list[np.ndarray | None] = []
        with self._lock:
            for start in range(0, len(keys), len(self._rows)):
                end = start + len(self._rows)
                found += self._get_batch(keys[start:end], outs[start:end])
        return found

    def _get_batch(self, keys: Sequence[str], outs: Sequence[np.ndarray | None]
                   ) -> list[np.ndarray | None]:
        digests = [key_digest(k) for k in keys]
        arrived = self._read([h for h, _ in digests])
        found: list[np.ndarray | None] = []
        for row, ((_, check), out) in enumerate(zip(digests, outs)):
            payload = self._payload(row, check) if arrived[row] else None
            if payload is None or (out is not None and payload.nbytes != out.nbytes):
                found.append(None)
            elif out is None:
                found.append(payload.copy())
            else:
                out[:] = payload
                found.append(out)
        return found

    def _read(self, hashes: list[int]) -> list[bool]:
        """Reads into staging row i the block of hashes[i]; per row, whether it arrived.
        ``KVStore.get`` stops at the first block missing or corrupt (and drops a corrupt
        one), so we skip that one and read on from the next."""
        arrived = [False] * len(hashes)
        rows = [i for i, h in enumerate(hashes) if self._stored(h)]
        while rows:
            n = self.store.get([hashes[i] for i in rows], self._staging, rows).wait(_TIMEOUT_S)
            for i in rows[:n]:
                arrived[i] = True
            rows = rows[n + 1:]
        return arrived

    def _payload(self, row: int, check: bytes) -> np.ndarray | None:
        block = self._rows[row]
        nbytes = int.from_bytes(block[:8].tobytes(), "little")
        if block[8:HEADER_NBYTES].tobytes() != check or nbytes > self.max_nbytes:
            return None  # another key's record under a colliding hash
        return block[HEADER_NBYTES:HEADER_NBYTES + nbytes]

    def close(self) -> None:
        self.store.close()


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _to_int(name: str, value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    _require_int(name, value, minimum=1)
    assert isinstance(value, int)
    return value


def _gb_to_nbytes(name: str, value: object) -> int:
    """GB (GiB) as LMCache writes sizes, a number or a numeric string, to bytes."""
    try:
        gb = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number of GB, got {value!r}") from None
    if isinstance(value, bool) or not gb >= 0 or gb == float("inf"):
        raise ConfigError(f"{name} must be a finite number of GB >= 0, got {value!r}")
    return int(gb * _GIB)
