"""Storage tiers below the live KVCache: what each one is (``HostTier``, ``DiskTier``, the
configs users pass to ``KVStore``) and how it keeps blocks (``OpenTier``, one per open store).

A tier holds whole blocks (every layer) in numbered slots, and an index hash -> slot kept in
least-recently-used order. The host tier's slots are the blocks of a ``KVCache`` of its own;
the disk tier's are slots of a ``BlockFile`` (``csrc/storage/block_file.h``) with an
``IndexJournal``, in a folder only the serving user can read (``private.py``). Bytes move in
C++ with the GIL released; the index lives here, changed only by the store's I/O thread
(``kvmove/store/store.py``), read by lookups under the store's lock.
"""

from __future__ import annotations

import fcntl
import heapq
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvmove import _C
from kvmove.errors import ConfigError, StoreError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec
from kvmove.store.index import IndexJournal
from kvmove.store.private import open_private, private_folder
from kvmove.validation import require_positive_int

__all__ = ["DiskTier", "HostTier", "OpenTier", "TierStats"]

logger = logging.getLogger(__name__)

_EMA = 0.3  # weight of the newest measurement in a tier's read/write bandwidth


@dataclass(frozen=True, slots=True)
class HostTier:
    """Host memory for ``capacity_bytes`` of blocks (rounded down to whole blocks).

    Example:
        >>> tier = kvmove.HostTier(8 << 30)   # 8 GiB: 4,096 blocks of Llama-3.1-8B (2 MiB each)
    """

    capacity_bytes: int

    def __post_init__(self) -> None:
        require_positive_int("HostTier capacity_bytes", self.capacity_bytes)


@dataclass(frozen=True, slots=True)
class DiskTier:
    """A directory holding up to ``capacity_bytes`` of blocks (``blocks.dat``, ``index.kvm``).

    The directory (and any parent it makes) is 0700, its files 0600, whatever the umask:
    stored KV gives its prompts away. One of this user's that others can read is tightened;
    one of another user's is refused.

    ``direct``: read and write with O_DIRECT, past the page cache (the host tier is the
    memory cache; the page cache would double it and make disk reads look faster than the
    disk). Falls back to buffered I/O where the file system refuses O_DIRECT.

    Example:
        >>> tier = kvmove.DiskTier("/mnt/nvme/kv-store", 200 << 30)   # 200 GiB, persistent
    """

    path: str
    capacity_bytes: int
    direct: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ConfigError(f"DiskTier path must be a non-empty path, got {self.path!r}")
        require_positive_int("DiskTier capacity_bytes", self.capacity_bytes)


@dataclass
class TierStats:
    """Counters of one tier since the store opened (blocks, bytes, seconds)."""

    hits: int = 0            # blocks a lookup found here (the first tier holding each)
    misses: int = 0          # blocks a lookup looked for here and did not find
    served: int = 0          # blocks get() brought back from here
    corrupt: int = 0         # blocks that failed their checksum or could not be read: dropped
    stored: int = 0          # blocks written here (put, or demoted from the tier above)
    evicted: int = 0         # blocks pushed out to make room (demoted, or dropped from the last)
    write_errors: int = 0    # writes that failed (a full disk): the blocks were not stored
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    read_gbps: float | None = None   # recent read bandwidth (moving average), None: no read yet
    write_gbps: float | None = None

    def record_write(self, nbytes: int, seconds: float) -> None:
        self.bytes_written += nbytes
        self.write_seconds += seconds
        self.write_gbps = _average(self.write_gbps, nbytes, seconds)

    def record_read(self, nbytes: int, seconds: float) -> None:
        self.bytes_read += nbytes
        self.read_seconds += seconds
        self.read_gbps = _average(self.read_gbps, nbytes, seconds)


def _average(old: float | None, nbytes: int, seconds: float) -> float | None:
    if nbytes == 0 or seconds <= 0:
        return old
    gbps = nbytes / seconds / 1e9
    return gbps if old is None else _EMA * gbps + (1 - _EMA) * old


@dataclass
class OpenTier:
    """One tier of an open store: its slots, its LRU index, its counters and its bytes."""

    name: str
    num_slots: int
    block_nbytes: int
    cache: KVCache | None = None          # host: the blocks themselves
    file: Any = None                      # disk: a _C.BlockFile
    journal: IndexJournal | None = None   # disk: the persistent index
    index: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)
    free: list[int] = field(default_factory=list)  # a heap: lowest slots first, runs coalesce
    stats: TierStats = field(default_factory=TierStats)
    lock_fd: int = -1
    full: bool = False                    # the disk said ENOSPC: reuse written slots only
    written: set[int] = field(default_factory=set)  # disk slots written at least once

    @classmethod
    def open(cls, spec: HostTier | DiskTier, layout: KVSpec, fingerprint: dict[str, Any],
             weights: str = "") -> OpenTier:
        """A tier of blocks of ``layout``; a disk tier also checks its directory against
        ``fingerprint`` and ``weights`` (``IndexJournal``)."""
        nbytes = layout.bytes_per_block
        if isinstance(spec, HostTier):
            n = _blocks_in(spec.capacity_bytes, nbytes, "HostTier")
            tier = cls("host", n, nbytes, cache=KVCache(layout, n, pin=None))  # pinned: DMA
            tier.free = list(range(n))
            return tier
        return cls._open_disk(spec, layout, fingerprint, weights)

    @classmethod
    def _open_disk(cls, spec: DiskTier, layout: KVSpec, fingerprint: dict[str, Any],
                   weights: str) -> OpenTier:
        path = os.fspath(spec.path)
        private_folder(path)
        try:
            lock_fd = open_private(os.path.join(path, "lock"), os.O_RDWR)
        except OSError as error:
            raise StoreError(f"cannot use {path!r} as a disk tier: {error}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise StoreError(f"disk tier {path!r} is in use by another store (one process per "
                             "directory)") from None
        journal = None
        try:
            num_slots = _blocks_in(spec.capacity_bytes, _slot_nbytes(layout), "DiskTier")
            # The journal first: it refuses another layout before the data file is touched.
            journal = IndexJournal(os.path.join(path, "index.kvm"),
                                   {**fingerprint, "slot_nbytes": _slot_nbytes(layout)},
                                   num_slots, weights)
            data = os.path.join(path, "blocks.dat")
            os.close(open_private(data, os.O_RDWR))  # 0600 before the core opens it
            file = _C.BlockFile(data, layout.bytes_per_block, num_slots, spec.direct)
        except BaseException as error:
            if journal is not None:
                journal.close()
            os.close(lock_fd)
            if isinstance(error, OSError):
                raise StoreError(f"cannot use {path!r} as a disk tier: {error}") from None
            raise
        tier = cls("disk", file.num_slots, layout.bytes_per_block, file=file, journal=journal,
                   index=journal.entries, lock_fd=lock_fd)
        used = {slot for slot, _ in journal.entries.values()}
        tier.free = [s for s in range(file.num_slots) if s not in used]
        tier.written = used
        return tier

    # --- index (the store's I/O thread changes it, lookups read it) -----------------------

    def take_slots(self, n: int) -> list[int]:
        return [heapq.heappop(self.free) for _ in range(n)]

    def lru(self, n: int, keep: set[int]) -> list[int]:
        """The ``n`` least recently used hashes not in ``keep``."""
        out: list[int] = []
        for h in self.index:
            if len(out) == n:
                break
            if h not in keep:
                out.append(h)
        return out

    def remove(self, hashes: list[int]) -> None:
        slots = [self.index[h][0] for h in hashes if h in self.index]
        if self.journal is not None:
            self.journal.drop(hashes)   # before the slots can be reused
        else:
            for h in hashes:
                self.index.pop(h, None)
        for slot in slots:
            heapq.heappush(self.free, slot)

    def touch(self, block_hash: int) -> None:
        self.index.move_to_end(block_hash)

    # --- bytes (no lock held) -------------------------------------------------------------

    def write(self, cache: KVCache, ids: list[int], hashes: list[int],
              slots: list[int]) -> list[tuple[int, int, int]]:
        """Copies blocks into slots; ``(hash, slot, checksum)`` of those written. Slots not
        written go back to the free heap, except after a full disk (see ``_disk_full``)."""
        start = time.perf_counter()
        if self.cache is not None:  # host (a disk tier has a file instead)
            _C.copy_blocks(cache._core, ids, self.cache._core, slots)
            # The disk tier's checksum of the same bytes (XXH3 of every layer, seeded with the
            # content hash), computed on the tier's copy: what a read checks.
            checksums = _C.block_checksums(self.cache._core, slots, hashes)
            written = list(zip(hashes, slots, checksums))
        else:
            written = self._write_file(cache, ids, hashes, slots)
        self.stats.stored += len(written)
        self.stats.record_write(len(written) * self.block_nbytes, time.perf_counter() - start)
        return written

    def _write_file(self, cache: KVCache, ids: list[int], hashes: list[int],
                    slots: list[int]) -> list[tuple[int, int, int]]:
        try:
            checksums = self.file.write(cache._core, ids, slots, hashes)
            self.written.update(slots)
            return list(zip(hashes, slots, checksums))
        except StoreError as error:
            self.stats.write_errors += 1
            if "No space" not in str(error):
                logger.warning("disk tier: %d blocks not stored (%s)", len(ids), error)
                for slot in slots:
                    heapq.heappush(self.free, slot)
                return []
        # A full disk: the file is sparse, so a slot never written has no space behind it and
        # may have none now. Store what still fits one block at a time, then reuse only
        # slots that were written once (eviction frees them).
        written = []
        for i, slot, h in zip(ids, slots, hashes):
            try:
                (checksum,) = self.file.write(cache._core, [i], [slot], [h])
            except StoreError:
                break
            self.written.add(slot)
            written.append((h, slot, checksum))
        self._disk_full(slots[len(written):])
        return written

    def _disk_full(self, unwritten: list[int]) -> None:
        if not self.full:
            logger.warning("disk tier %s is full: %d of %d slots usable", self.file.path,
                           len(self.written), self.num_slots)
        self.full = True
        self.free = [s for s in [*self.free, *unwritten] if s in self.written]
        heapq.heapify(self.free)

    def read(self, cache: KVCache, ids: list[int], hashes: list[int]) -> int:
        """Copies stored blocks into ``ids`` of ``cache``; how many leading ones arrived
        intact (the caller drops the first bad one)."""
        entries = [self.index[h] for h in hashes]
        slots = [slot for slot, _ in entries]
        start = time.perf_counter()
        if self.cache is not None:  # host: checked in place, then only intact ones copied
            sums = _C.block_checksums(self.cache._core, slots, hashes)
            ok = [int(a == b) for a, (_, b) in zip(sums, entries)]
            n = ok.index(0) if 0 in ok else len(ok)
            _C.copy_blocks(self.cache._core, slots[:n], cache._core, ids[:n])
        else:
            ok = self.file.read(cache._core, ids, slots, hashes, [c for _, c in entries])
        self.stats.record_read(len(ids) * self.block_nbytes, time.perf_counter() - start)
        return ok.index(0) if 0 in ok else len(ok)

    def insert(self, items: list[tuple[int, int, int]]) -> None:
        if self.journal is not None:
            self.journal.put(items)
        else:
            for h, slot, checksum in items:
                self.index[h] = (slot, checksum)

    def close(self) -> None:
        if self.journal is not None:
            try:
                self.file.sync()
            except StoreError as error:
                logger.warning("disk tier: %s", error)
            self.file.close()
            self.journal.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def _slot_nbytes(layout: KVSpec) -> int:
    align = _C.BlockFile.SLOT_ALIGN
    return -(-layout.bytes_per_block // align) * align


def _blocks_in(capacity_bytes: int, block_nbytes: int, what: str) -> int:
    n = capacity_bytes // block_nbytes
    if n < 1:
        raise ConfigError(f"{what} capacity_bytes {capacity_bytes} holds no block: one block "
                          f"takes {block_nbytes} B")
    return n
