"""A worker's KV events: which block hashes its prefix cache and its KVStore gained or lost,
for the router's ``KVIndex`` (KV-aware routing).

The prefix cache is the C++ ``BlockPool``: it evicts inside ``allocate`` and tells no one, so
we diff instead of hooking. ``take`` reads every block's hash (``BlockPool.block_hash``: about
0.6 ms for 2,048 blocks) and compares with what was last announced; it runs after engine
steps, only when a step ran since the last diff and at most every ``MIN_SECONDS``, so an
idle worker costs nothing and a busy one a few percent of a core. The store says what changed
itself (``KVStore.take_changes``, O(changes)).

Only "held or not" travels: the router needs where a prefix is, not which block holds it.
"""

from __future__ import annotations

import time

from kvmove.block_pool import BlockPool
from kvmove.serve.messages import MAX_KV_HASHES, KVEvents, Medium
from kvmove.store import KVStore

__all__ = ["KVEventSource", "MIN_SECONDS", "batches"]

MIN_SECONDS = 0.02  # between two diffs of a busy worker's cache: a repeat prefix arriving
                    # later than this after its first request finds it in the router's index


class KVEventSource:
    """What ``pool`` (and ``store``) hold, as stored/removed events since the last call."""

    def __init__(self, pool: BlockPool, store: KVStore | None = None) -> None:
        self.pool, self.store = pool, store
        self._announced: set[int] = set()
        self._dirty = False
        self._last = 0.0

    def stepped(self) -> None:
        """An engine step ran: the cache may have changed."""
        self._dirty = True

    def take(self, now: float | None = None, force: bool = False) -> list[KVEvents]:
        """The events since the last call (none when nothing changed, or a diff is not due)."""
        now = time.monotonic() if now is None else now
        if not force and (not self._dirty or now - self._last < MIN_SECONDS):
            return self._store_events()
        self._dirty, self._last = False, now
        held = self._held()
        stored, removed = held - self._announced, self._announced - held
        self._announced = held
        return batches("cache", sorted(stored), sorted(removed)) + self._store_events()

    def _held(self) -> set[int]:
        hashes = (self.pool.block_hash(i) for i in range(self.pool.num_blocks))
        return {h for h in hashes if h is not None}

    def _store_events(self) -> list[KVEvents]:
        if self.store is None:
            return []
        changes = self.store.take_changes()
        stored = sorted(h for h, tier in changes.items() if tier is not None)
        removed = sorted(h for h, tier in changes.items() if tier is None)
        return batches("store", stored, removed)


def batches(medium: Medium, stored: list[int], removed: list[int]) -> list[KVEvents]:
    """``stored`` and ``removed`` in messages of at most ``MAX_KV_HASHES`` hashes each."""
    events = []
    for kind, hashes in (("stored", stored), ("removed", removed)):
        for start in range(0, len(hashes), MAX_KV_HASHES):
            part = hashes[start:start + MAX_KV_HASHES]
            events.append(KVEvents(medium=medium, stored=part if kind == "stored" else [],
                                   removed=part if kind == "removed" else []))
    return events
