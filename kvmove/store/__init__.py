"""``KVStore``: KV blocks kept below the live cache by content hash, so a repeated prefix is
loaded instead of prefilled again.

``store.py`` is the store (lookups, the load-or-recompute decision, the I/O thread),
``tiers.py`` the host and disk tiers it keeps blocks in, ``index.py`` the disk tier's index
journal, ``private.py`` the disk tier's folder and files that only the serving user can read.
``kvmove.store`` is the import path: everything public is here.
"""

from __future__ import annotations

from kvmove.store.store import LOAD_POLICIES, KVStore, Lookup, StoreHandle, StoreStats, decide_load
from kvmove.store.tiers import DiskTier, HostTier

__all__ = ["DiskTier", "HostTier", "KVStore", "LOAD_POLICIES", "Lookup", "StoreHandle",
           "StoreStats", "decide_load"]
