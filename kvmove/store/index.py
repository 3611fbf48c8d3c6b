"""The disk tier's index: which slot of its block file holds which block, kept as a journal.

File ``index.kvm`` in the tier's directory::

    | b"KVMINDEX" | u32 version | u32 n | n bytes: JSON fingerprint | record | record | ...

    record (32 B, little-endian): u8 op (1 put, 2 drop) | 3 pad | u32 crc32 of the record
                                  with this field zeroed | i64 slot | u64 hash | u64 checksum

A put is appended only after its bytes were written, a drop before its slot is reused, so the
journal never points at a slot that was not written for it. Replaying it at open rebuilds the
index; a torn last record (a crash mid-append) fails its crc32 and is cut off. Nothing is
fsynced per record: after a machine crash the journal may name data that never reached the disk,
and the block checksum turns that into a miss on read. When dead records outnumber live
entries the journal is rewritten (to a temporary file, then renamed over the old one).

The fingerprint says what the blocks are (layout, namespace, slot size): a journal of another
one is refused. Its ``weights`` entry says what computed them: a journal of other weights is
emptied instead (the same model with new weights, saved under the same name: its blocks are
stale, never served, and their slots are reused). Both files are 0600 (``private.py``).

Why a journal and not an index rewritten on every change: appends are O(1) per block and a
restart loses nothing written before it; a rewritten index would be O(entries) per change.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from typing import Any

from kvmove.errors import StoreError
from kvmove.store.private import open_private

__all__ = ["IndexJournal"]

logger = logging.getLogger(__name__)

_MAGIC = b"KVMINDEX"
_VERSION = 2  # 2: block checksums are XXH3 (1: XXH64)
_HEADER = struct.Struct("<8sII")
_RECORD = struct.Struct("<B3xIqQQ")
_PUT, _DROP = 1, 2


class IndexJournal:
    """The index of one disk tier: ``entries`` maps hash -> (slot, checksum), oldest first.

    Args:
        path: the journal file (created when missing).
        fingerprint: what the blocks are (layout, namespace, slot size); an existing journal
            with another fingerprint is refused with StoreError.
        num_slots: the block file's slots now; entries in slots past it are dropped.
        weights: what computed the blocks (an identity of the model's weights; "": not
            said); an existing journal of other weights is emptied, not refused.
    """

    def __init__(self, path: str, fingerprint: dict[str, Any], num_slots: int,
                 weights: str = "") -> None:
        self.path = path
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        # No "weights" key when none is said: journals written before it existed still open.
        self._header = self._encode_header({**fingerprint, "weights": weights} if weights
                                           else fingerprint)
        self._num_records = 0
        self.num_unrecorded = 0  # records a write error kept out of the file
        if os.path.exists(path):
            self._replay(fingerprint, weights, num_slots)
            if any(slot >= num_slots for slot, _ in self.entries.values()):
                self.entries = OrderedDict((h, e) for h, e in self.entries.items()
                                           if e[0] < num_slots)
                self._rewrite()
        else:
            self._rewrite()
        self._fd = open_private(path, os.O_WRONLY | os.O_APPEND)

    @staticmethod
    def _encode_header(fingerprint: dict[str, Any]) -> bytes:
        text = json.dumps(fingerprint, sort_keys=True).encode()
        return _HEADER.pack(_MAGIC, _VERSION, len(text)) + text

    def _replay(self, fingerprint: dict[str, Any], weights: str, num_slots: int) -> None:
        with open(self.path, "rb") as f:
            data = f.read()
        magic, version, n = _HEADER.unpack_from(data) if len(data) >= _HEADER.size else (b"", 0, 0)
        if magic != _MAGIC or version not in (1, _VERSION):
            raise StoreError(f"{self.path} is not a kvmove store index (version {_VERSION})")
        try:
            stored = json.loads(data[_HEADER.size:_HEADER.size + n])
        except ValueError as error:
            raise StoreError(f"{self.path} has a damaged header: {error}") from None
        stored_weights = stored.pop("weights", "") if isinstance(stored, dict) else ""
        if stored != json.loads(json.dumps(fingerprint)):
            raise StoreError(f"{os.path.dirname(self.path) or '.'} holds KV blocks of another "
                             f"layout: stored {stored}, this store {fingerprint}; open another "
                             "directory or delete this one")
        if version == 1:  # XXH64 checksums: every block would read back as corrupt
            logger.warning("%s: the blocks were stored by an older kvmove (XXH64 checksums, "
                           "now XXH3): dropped, their slots reused",
                           os.path.dirname(self.path) or ".")
            self._rewrite()
            return
        if stored_weights != weights:
            logger.warning("%s: the blocks were computed by other weights (%s, now %s): "
                           "dropped, their slots reused", os.path.dirname(self.path) or ".",
                           stored_weights or "not said", weights or "not said")
            self._rewrite()  # no entries: only the new header
            return
        offset = good = _HEADER.size + n
        slot_of: dict[int, int] = {}  # slot -> hash, so a reused slot drops its old block
        while offset + _RECORD.size <= len(data):
            record = data[offset:offset + _RECORD.size]
            op, crc, slot, block_hash, checksum = _RECORD.unpack(record)
            if crc != _crc(op, slot, block_hash, checksum) or op not in (_PUT, _DROP):
                break  # torn or damaged: everything after it is suspect too
            offset += _RECORD.size
            good = offset
            self._apply(op, slot, block_hash, checksum, slot_of)
        self._num_records = (good - _HEADER.size - n) // _RECORD.size
        if good < len(data):
            os.truncate(self.path, good)

    def _apply(self, op: int, slot: int, block_hash: int, checksum: int,
               slot_of: dict[int, int]) -> None:
        if op == _DROP:
            entry = self.entries.pop(block_hash, None)
            if entry is not None:
                slot_of.pop(entry[0], None)
            return
        old = slot_of.get(slot)
        if old is not None:
            self.entries.pop(old, None)
        self.entries.pop(block_hash, None)
        self.entries[block_hash] = (slot, checksum)
        slot_of[slot] = block_hash

    def put(self, items: list[tuple[int, int, int]]) -> None:
        """Records ``(hash, slot, checksum)`` for blocks whose bytes are written."""
        for h, slot, checksum in items:  # first: a compaction in _append writes the entries
            self.entries.pop(h, None)
            self.entries[h] = (slot, checksum)
        self._append([(_PUT, slot, h, checksum) for h, slot, checksum in items])

    def drop(self, hashes: list[int]) -> None:
        """Forgets blocks (before their slots are reused)."""
        gone = [(h, self.entries.pop(h)) for h in hashes if h in self.entries]
        self._append([(_DROP, slot, h, checksum) for h, (slot, checksum) in gone])

    def touch(self, block_hash: int) -> None:
        """Marks a block most recently used (in memory only: a restart keeps write order)."""
        self.entries.move_to_end(block_hash)

    def _append(self, records: list[tuple[int, int, int, int]]) -> None:
        """Appends records; on a full disk (or any write error) the journal is cut back to its
        last whole record and the change stays in memory only: after a restart that block
        is a miss (a lost put) or a checksum failure (a lost drop whose slot was reused),
        never wrong data."""
        if not records:
            return
        data = b"".join(_RECORD.pack(op, _crc(op, slot, h, c), slot, h, c)
                        for op, slot, h, c in records)
        size = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as error:
            self.num_unrecorded += len(records)
            logger.warning("store index %s: %d records not written (%s)", self.path,
                           len(records), error)
            _truncate(self._fd, size)
            return
        self._num_records += len(records)
        if self._num_records > 2 * len(self.entries) + 4096:
            self._compact()

    def _compact(self) -> None:
        try:
            self._rewrite()
        except OSError as error:  # a full disk: keep appending to the old journal
            logger.warning("store index %s: not compacted (%s)", self.path, error)
            return
        os.close(self._fd)
        self._fd = open_private(self.path, os.O_WRONLY | os.O_APPEND)

    def _rewrite(self) -> None:
        """The live entries, oldest first, into a new journal that replaces the old one."""
        tmp = self.path + ".tmp"
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
                f.write(self._header)
                f.write(b"".join(_RECORD.pack(_PUT, _crc(_PUT, slot, h, c), slot, h, c)
                                 for h, (slot, c) in self.entries.items()))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
        self._num_records = len(self.entries)

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as error:  # the records are in the page cache; a crash may lose them
            logger.warning("store index %s: not synced (%s)", self.path, error)

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1


def _truncate(fd: int, size: int) -> None:
    with contextlib.suppress(OSError):  # shrinking needs no space; if even that fails, the
        os.ftruncate(fd, size)          # torn tail is cut off at the next open


def _crc(op: int, slot: int, block_hash: int, checksum: int) -> int:
    return zlib.crc32(_RECORD.pack(op, 0, slot, block_hash, checksum))
