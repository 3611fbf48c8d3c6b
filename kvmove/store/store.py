"""KVStore: KV blocks kept below the live cache, by content hash, so a repeated prefix is
loaded instead of prefilled again.

Tiers, fastest first (``kvmove/store/tiers.py``)::

    live KVCache (the engine's)  --put-->  HostTier  --demote (LRU)-->  DiskTier  --> dropped
                                 <--get--            <------get--------

* Keys are the chained block hashes of ``kvmove.block_hashes``: equal hashes, equal prefixes.
* ``put`` copies blocks into the first tier; a full tier pushes its least recently used blocks
  one tier down, and the last tier drops them. Capacities are never exceeded.
* ``lookup`` says how many leading blocks are stored, where, and whether loading them beats
  recomputing them (the ``Lookup``); ``get`` brings them back into live blocks.
* ``put`` and ``get`` run on the store's I/O thread and return a ``StoreHandle``: an engine
  computes while they run. The C++ below releases the GIL.
* Nothing in the engine's path raises for lack of room or a failing disk: a block that cannot
  be stored is reported as not stored, a block that reads back corrupt (its checksum, seeded
  with its hash, does not match) is dropped and reported as a miss. Never served.

Load or recompute: loading block i costs ``bytes_per_block / read bandwidth of its tier``,
recomputing it ``block_size / prefill tokens per second``. The store measures each tier's read
bandwidth on every ``get``; the engine reports its prefill throughput (``observe_prefill``).
``lookup`` picks the prefix length that saves the most time (loading a leading run, computing
the rest), and before anything is measured it assumes loading wins.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmove import _C
from kvmove.errors import ConfigError, StoreError, TimeoutError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec
from kvmove.store.tiers import DiskTier, HostTier, OpenTier, TierStats
from kvmove.wrap import ORDERS

__all__ = ["DiskTier", "HostTier", "KVStore", "LOAD_POLICIES", "Lookup", "StoreHandle",
           "StoreStats", "decide_load"]

logger = logging.getLogger(__name__)

LOAD_POLICIES = ("auto", "always")
_EMA = 0.3


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the store holds of a prefix, and whether to load it.

    ``int(lookup)`` is ``num_blocks``. The decision is ``load_blocks``: load that many leading
    blocks and recompute the rest (0: recompute everything).

    Example:
        >>> found = store.lookup(kvmove.block_hashes(tokens, layout.block_size))
        >>> found.tiers, found.decision       # e.g. (('host', 'host', 'disk'), 'load')
        >>> store.get(hashes[:found.load_blocks], cache, ids[:found.load_blocks]).wait(5.0)
    """

    tiers: tuple[str, ...]            # the tier of each leading stored block
    load_blocks: int
    load_seconds: float | None        # estimated time to load the ``load_blocks``
    recompute_seconds: float | None   # estimated time to prefill the same blocks instead
    read_gbps: dict[str, float | None]
    prefill_tokens_per_second: float | None

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def decision(self) -> str:
        """``"load"``, ``"recompute"``, ``"partial"`` (load some), or ``"miss"`` (none stored)."""
        if not self.tiers:
            return "miss"
        if self.load_blocks == len(self.tiers):
            return "load"
        return "partial" if self.load_blocks else "recompute"

    def __int__(self) -> int:
        return len(self.tiers)

    __index__ = __int__


def decide_load(tiers: Sequence[str], read_gbps: dict[str, float | None],
                prefill_tokens_per_second: float | None, layout: KVSpec,
                load_policy: str = "auto") -> Lookup:
    """The load-or-recompute rule of ``KVStore.lookup``, for a caller that holds the inputs
    but not the store (vLLM's scheduler decides while the store lives in the worker).

    Args:
        tiers: the tier name of each leading stored block.
        read_gbps: measured read bandwidth per tier name (None: not measured yet).
        prefill_tokens_per_second: the engine's measured prefill throughput (None: unknown).
        layout: gives the bytes and tokens of one block.
        load_policy: "auto" (decide from the measurements) or "always".
    """
    tiers = tuple(tiers)
    per_block = layout.bytes_per_block
    load = [0.0 if (gbps := read_gbps.get(name)) is None else per_block / (gbps * 1e9)
            for name in tiers]
    tps = prefill_tokens_per_second
    compute = None if tps is None else layout.block_size / tps
    best, saved, gain = len(tiers), 0.0, 0.0  # unmeasured: load everything
    if compute is not None and load_policy == "auto":
        best = 0
        for i, cost in enumerate(load):
            saved += compute - cost
            if saved > gain:
                best, gain = i + 1, saved
    unknown = any(read_gbps.get(name) is None for name in tiers[:best])
    return Lookup(tiers, best, None if unknown else sum(load[:best]),
                  None if compute is None else compute * best, dict(read_gbps), tps)


@dataclass
class StoreStats:
    """A snapshot of a store's counters: per tier, and the decisions its lookups made."""

    tiers: dict[str, TierStats]
    blocks: dict[str, int]             # blocks held per tier now
    capacity_blocks: dict[str, int]
    lookups: int = 0
    lookup_misses: int = 0             # blocks asked for that no tier held
    decisions: dict[str, int] = field(default_factory=dict)
    prefill_tokens_per_second: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class StoreHandle:
    """A ``put`` or ``get`` in flight. ``wait`` gives its result: blocks stored (put) or
    leading blocks brought back intact (get).

    Example:
        >>> handle = store.put(hashes, cache, ids)   # returns at once; an I/O thread copies
        >>> handle.wait(timeout=5.0) == len(ids)     # the blocks may be reused after this
        True
    """

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float) -> int:
        """Raises ``kvmove.errors.TimeoutError`` past ``timeout`` seconds (the operation goes
        on: wait again before touching its blocks)."""
        _C.check_timeout(timeout)
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"store operation not done after {timeout:g} s") from None


class KVStore:
    """Storage tiers for one model's KV blocks.

    Args:
        layout: the model's KV layout; caches passed to put/get must have it.
        tiers: ``HostTier`` and/or ``DiskTier``, at most one of each, host first.
        namespace: what else makes equal tokens give equal KV: the model (e.g. a checkpoint
            name and revision). Stored with the layout; a disk tier written under another
            namespace or layout is refused with ``StoreError``.
        weights: what computed the KV: an identity of the weights themselves
            (``kvmove.engine.weights_id``), for a model whose name stays when its weights
            change (a directory saved over). A disk tier written under the same namespace by
            other weights (or by weights not said) is emptied as it opens, never served.
        load_policy: ``"auto"``: lookups decide load or recompute from measurements;
            ``"always"``: lookups say load whatever is stored (the inputs are still reported).
        order: the element order inside the blocks it stores (``KVCache.order``): "NHD"
            (kvmove's own caches), "HND", "vllm-cpu" or "mla" (default: "mla" for an MLA
            layout, else "NHD"). Stored with the layout; put and get take caches of this
            order only, so blocks never come back in another engine's order.

    Raises:
        ConfigError: tiers missing, repeated or out of order; a capacity under one block; an
            order that is not one of kvmove.wrap.ORDERS.
        StoreError: a disk tier directory that cannot be used.

    Example:
        >>> store = kvmove.KVStore(layout, [kvmove.HostTier(8 << 30),
        ...                                 kvmove.DiskTier("kv-store", 200 << 30)],
        ...                        namespace="llama-3.1-8b@main")
        >>> store.put(kvmove.block_hashes(tokens, 16), cache, ids).wait(timeout=5.0)
        >>> store.lookup(kvmove.block_hashes(tokens, 16)).decision
        'load'
    """

    def __init__(self, layout: KVSpec, tiers: Sequence[HostTier | DiskTier], *,
                 namespace: str = "", weights: str = "", load_policy: str = "auto",
                 order: str | None = None) -> None:
        if load_policy not in LOAD_POLICIES:
            raise ConfigError(f"load_policy must be one of {LOAD_POLICIES}, got {load_policy!r}")
        self.load_policy = load_policy
        kinds = [type(t).__name__ for t in tiers]
        if not tiers or kinds not in (["HostTier"], ["DiskTier"], ["HostTier", "DiskTier"]):
            raise ConfigError(f"tiers must be [HostTier], [DiskTier] or [HostTier, DiskTier], "
                              f"got {kinds}")
        self.layout = layout
        self.namespace = namespace
        self.weights = weights
        self.order = ("mla" if layout.mla else "NHD") if order is None else order
        if self.order not in ORDERS:
            raise ConfigError(f"order must be one of {ORDERS}, got {self.order!r}")
        described = asdict(layout)
        if not layout.mla:  # as before KVSpec had mla: stores written then still open
            del described["mla"]
        fingerprint = {"layout": described, "namespace": namespace}
        if self.order not in ("NHD", "mla"):  # likewise: the orders stores held before
            fingerprint["order"] = self.order
        self._tiers: list[OpenTier] = []
        try:
            for spec in tiers:
                self._tiers.append(OpenTier.open(spec, layout, fingerprint, weights))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvmove-store")
        self._prefill_tps: float | None = None
        self._lookups = self._lookup_misses = 0
        self._decisions = {"load": 0, "partial": 0, "recompute": 0, "miss": 0}
        self._changed = {h for t in self._tiers for h in t.index}  # see take_changes
        self._closed = False

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    # --- lookup and the load-or-recompute decision ----------------------------------------

    def lookup(self, hashes: Sequence[int]) -> Lookup:
        """The leading ``hashes`` stored (each in the fastest tier holding it) and the
        decision. Counts, as a cache hierarchy does, a hit in the tier that held a block and a
        miss in each tier above it (a block held nowhere: a miss in every tier)."""
        with self._lock:
            tiers: list[str] = []
            for h in hashes:
                tier = self._holder(h)
                for t in self._tiers[:self._tiers.index(tier) if tier else len(self._tiers)]:
                    t.stats.misses += 1  # looked for here, first
                if tier is None:
                    break
                tiers.append(tier.name)
                tier.stats.hits += 1
                tier.touch(h)  # asked for: recently used, whether loaded or recomputed
            self._lookups += 1
            self._lookup_misses += len(hashes) - len(tiers)
            result = self._decide(tuple(tiers))
            self._decisions[result.decision] += 1
            return result

    def _decide(self, tiers: tuple[str, ...]) -> Lookup:
        read = {t.name: t.stats.read_gbps for t in self._tiers}
        return decide_load(tiers, read, self._prefill_tps, self.layout, self.load_policy)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine's measured prefill throughput (a moving average of these)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        tps = num_tokens / seconds
        with self._lock:
            old = self._prefill_tps
            self._prefill_tps = tps if old is None else _EMA * tps + (1 - _EMA) * old

    # --- put and get ----------------------------------------------------------------------

    def put(self, hashes: Sequence[int], cache: KVCache, block_ids: Sequence[int]) -> StoreHandle:
        """Stores blocks ``block_ids`` of ``cache`` under ``hashes`` (those not stored yet).
        The blocks must not change until the handle is done; its result is how many of them
        the store holds afterwards."""
        hashes, ids = self._check(hashes, cache, block_ids)
        return self._submit(self._put, hashes, cache, ids)

    def get(self, hashes: Sequence[int], cache: KVCache, block_ids: Sequence[int]) -> StoreHandle:
        """Brings the stored blocks ``hashes`` back into ``block_ids`` of ``cache``, in order,
        stopping at the first one missing or corrupt; the result is how many leading blocks
        arrived (only those may be used)."""
        hashes, ids = self._check(hashes, cache, block_ids)
        return self._submit(self._get, hashes, cache, ids)

    def _check(self, hashes: Sequence[int], cache: KVCache,
               block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        if getattr(cache, "layout", None) != self.layout:
            raise ConfigError(f"the cache's layout {getattr(cache, 'layout', None)!r} is not "
                              f"the store's {self.layout!r}")
        if cache.order != self.order:
            raise ConfigError(f"the cache's blocks are in {cache.order} order, the store's in "
                              f"{self.order} (KVStore(order=))")
        hashes, ids = [int(h) for h in hashes], [int(i) for i in block_ids]
        if len(hashes) != len(ids):
            raise ConfigError(f"need one hash per block id, got {len(hashes)} hashes for "
                              f"{len(ids)} ids")
        if any(not 0 <= h < 2**64 for h in hashes):
            raise ConfigError(f"hashes must be in [0, 2**64), got {min(hashes)}..{max(hashes)}")
        if any(not 0 <= i < cache.num_blocks for i in ids):
            bad = next(i for i in ids if not 0 <= i < cache.num_blocks)
            raise ConfigError(f"block id {bad} is out of range: ids are in "
                              f"[0, {cache.num_blocks})")
        return hashes, ids

    def _submit(self, fn: Callable[..., int], *args: Any) -> StoreHandle:
        if self._closed:
            raise StoreError("the store is closed")
        return StoreHandle(self._io.submit(fn, *args))

    def _put(self, hashes: list[int], cache: KVCache, ids: list[int]) -> int:
        self._store(0, cache, ids, hashes)
        with self._lock:
            return sum(any(h in t.index for t in self._tiers) for h in hashes)

    def _store(self, level: int, cache: KVCache, ids: list[int], hashes: list[int]) -> None:
        """Puts blocks into tier ``level``. The leading blocks, as many as the tier holds,
        stay there (those it held already are touched); its least recently used other blocks
        go down (or out) to make room; the remainder goes straight to the tier below, after
        those older blocks, so LRU order holds across tiers."""
        tier = self._tiers[level]
        items = list(dict(zip(hashes, ids)).items())  # distinct, in order (a dict keeps the
        # first position of a key and its last value: the same hash is the same bytes)
        capacity = len(tier.index) + len(tier.free) if tier.full else tier.num_slots
        head, rest = items[:capacity], items[capacity:]
        with self._lock:
            new = [(h, i) for h, i in head if h not in tier.index]
            for h, _ in head:
                if h in tier.index:
                    tier.touch(h)
        if new:
            self._make_room(level, len(new), {h for h, _ in head})
        below = [(h, i) for h, i in rest if h not in tier.index]
        if below and level + 1 < len(self._tiers):
            self._store(level + 1, cache, [i for _, i in below], [h for h, _ in below])
        new = new[:len(tier.free)]  # a disk found full meanwhile may have fewer slots
        if not new:
            return
        slots = tier.take_slots(len(new))
        written = tier.write(cache, [i for _, i in new], [h for h, _ in new], slots)
        with self._lock:
            tier.insert(written)
            self._changed.update(h for h, _, _ in written)

    def _make_room(self, level: int, n: int, keep: set[int]) -> None:
        tier = self._tiers[level]
        short = n - len(tier.free)
        if short <= 0:
            return
        with self._lock:  # lookups reorder the index: iterate it under the lock
            victims = tier.lru(short, keep)
        if level + 1 < len(self._tiers) and tier.cache is not None:
            slots = [tier.index[h][0] for h in victims]
            # Only intact blocks go down: the tier below would checksum damaged bytes afresh.
            sums = _C.block_checksums(tier.cache._core, slots, victims)
            intact = [(h, s) for h, s, c in zip(victims, slots, sums) if c == tier.index[h][1]]
            tier.stats.corrupt += len(victims) - len(intact)
            self._store(level + 1, tier.cache, [s for _, s in intact], [h for h, _ in intact])
        with self._lock:
            tier.remove(victims)
            tier.stats.evicted += len(victims)
            self._changed.update(victims)

    def _get(self, hashes: list[int], cache: KVCache, ids: list[int]) -> int:
        """Reads runs of blocks tier by tier; stops at the first block missing or bad."""
        done = 0
        while done < len(hashes):
            tier = self._holder(hashes[done])
            if tier is None:
                break
            end = done + 1
            while end < len(hashes) and self._holder(hashes[end]) is tier:
                end += 1
            n = tier.read(cache, ids[done:end], hashes[done:end])
            with self._lock:
                for h in hashes[done:done + n]:
                    tier.touch(h)
                tier.stats.served += n
                if done + n < end:  # corrupt, torn or unreadable: never served again
                    tier.stats.corrupt += 1
                    tier.remove([hashes[done + n]])
                    self._changed.add(hashes[done + n])
            done += n
            if done < end:
                break
        return done

    def take_changes(self) -> dict[int, str | None]:
        """Blocks whose tier changed since the last call (all blocks held, on the first):
        hash -> the fastest tier holding it now, or None when none does (dropped, or found
        corrupt). For a mirror of the index kept elsewhere: vLLM's scheduler decides what to
        load in another process than the worker that holds the store, and needs to know
        what is held without asking per request. Costs O(changes), not O(blocks held)."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return {h: getattr(self._holder(h), "name", None) for h in changed}

    def _holder(self, block_hash: int) -> OpenTier | None:
        """The fastest tier holding a block. The I/O thread, the index's only writer, calls
        it without the lock; other threads hold the lock."""
        return next((t for t in self._tiers if block_hash in t.index), None)

    # --- metrics and life cycle ------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                tiers={t.name: TierStats(**asdict(t.stats)) for t in self._tiers},
                blocks={t.name: len(t.index) for t in self._tiers},
                capacity_blocks={t.name: t.num_slots for t in self._tiers},
                lookups=self._lookups, lookup_misses=self._lookup_misses,
                decisions=dict(self._decisions), prefill_tokens_per_second=self._prefill_tps)

    def flush(self, timeout: float = 60.0) -> None:
        """Waits for every queued operation, then syncs the disk tier's data and index."""
        def sync() -> int:
            for tier in self._tiers:
                if tier.journal is not None:
                    tier.file.sync()
                    tier.journal.sync()
            return 0
        self._submit(sync).wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Finishes queued operations and closes the tiers (the disk tier's index is synced).

        An I/O thread still busy after ``timeout`` seconds (a hung disk) leaves the tiers open
        rather than closing files under it; that is logged."""
        if getattr(self, "_closed", True) is False:
            self._closed = True
            last = self._io.submit(int)  # runs after everything queued before it
            self._io.shutdown(wait=False)
            try:
                last.result(timeout)
            except FutureTimeout:
                logger.warning("store I/O still busy after %g s: its tiers stay open", timeout)
                return
        for tier in self._tiers:
            tier.close()
        self._tiers = []

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (interpreter exit)
            pass

    def __repr__(self) -> str:
        parts = ", ".join(f"{t.name}: {len(t.index)}/{t.num_slots} blocks" for t in self._tiers)
        return f"KVStore({self.layout!r}, {parts})"
