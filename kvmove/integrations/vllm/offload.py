"""Offload (``kv_role: kv_both``, ``"offload": true``): vLLM's KV blocks kept in a
``kvmove.KVStore`` (host, then disk), so a repeated prefix is loaded instead of prefilled
again, when loading is faster.

Who does what (vLLM runs the two sides in different processes)::

    engine core: OffloadScheduler                worker: OffloadWorker (beside the KV tensors)
      index: store key -> tier (a mirror)          KVStore (owns the tiers' memory and files)
      get_num_new_matched_tokens: index +  --meta-->  start_load_kv: store.get, deadline;
        decide_load (measured rule)                    blocks not arriving -> load errors
      build_connector_meta: loads, saves   --meta-->  wait_for_save: store.put, deadline
      update_connector_output  <--worker meta--    take_changes, read GB/s, prefill tok/s

* Keys are vLLM's own block hashes (``request.block_hashes``: chained over the prefix, and
  covering LoRA, multimodal inputs and the cache salt), folded to 64 bits (``store_key``),
  so two requests share a stored block exactly when vLLM's prefix cache would share it.
* The index is a mirror of the worker's store, fed by ``KVStore.take_changes`` in each
  step's worker metadata: evictions, demotions to disk and corrupt blocks reach the
  scheduler one step later. We mirror the store instead of keeping a list of what the
  scheduler asked to store because the store evicts and demotes on its own (LRU across two
  tiers): a list would name blocks long gone and guess their tier, and the tier decides
  load or recompute. A block the mirror names that is gone by load time is not a problem
  of correctness: ``get`` stops at the first block missing or failing its checksum, the
  worker reports the rest as load errors, and vLLM (``kv_load_failure_policy: recompute``)
  recomputes them. Wrong KV is never served.
* Loads are synchronous (``(n, False)``): done in ``start_load_kv`` before the forward.
  Saves are synchronous too, in ``wait_for_save`` after the forward, of every block that
  became full this step: the blocks are then never read after vLLM frees them, so
  ``request_finished`` holds nothing. Both wait at most ``load_timeout`` seconds; past it
  the step fails with ``kvmove.errors.TimeoutError`` rather than go on while the store's
  I/O thread may still be copying into (or out of) blocks vLLM reuses.
* Load or recompute: ``kvmove.store.decide_load`` (``KVStore.lookup``'s rule) from each
  tier's measured read bandwidth and the prefill throughput the worker measures (tokens of
  a step over the time from its first layer to ``wait_for_save``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

import kvmove
from kvmove.errors import ConfigError, TimeoutError
from kvmove.integrations.vllm.config import ConnectorConfig, LoadPolicy, layout_of, wrap_kv_caches
from kvmove.integrations.vllm.kv_events import StoreEvents
from kvmove.integrations.vllm.tally import Tally
from kvmove.runtime import unpinned
from kvmove.store import decide_load

__all__ = ["OffloadMeta", "OffloadScheduler", "OffloadWorker", "OffloadWorkerMeta", "store_key"]

logger = logging.getLogger(__name__)

_GB = 1 << 30


def store_key(block_hash: bytes) -> int:
    """A store key (64 bits) for one of vLLM's block hashes. BLAKE2b rather than the first
    8 bytes: some of vLLM's hash functions give fewer than 8 well-mixed leading bytes."""
    return int.from_bytes(hashlib.blake2b(bytes(block_hash), digest_size=8).digest(), "little")


@dataclass
class OffloadMeta(KVConnectorMetadata):
    """Scheduler -> worker, one step: blocks to load before the forward, to save after it.
    Each job is ``(request id, store keys, block ids)``, one key per block."""

    loads: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    saves: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    num_tokens: int = 0   # tokens the step computes (for the prefill throughput)


@dataclass
class OffloadWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: what the store holds now (changes only), and the
    measurements the load-or-recompute rule needs."""

    changes: dict[int, str | None] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)   # requests with a load error this step
    read_gbps: dict[str, float | None] = field(default_factory=dict)
    prefill_tokens_per_second: float | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: a block counts as held only as well as the worst rank holds
        it (dropped anywhere: dropped; on disk anywhere: disk)."""
        assert isinstance(other, OffloadWorkerMeta)
        rank = {"host": 0, "disk": 1, None: 2}
        changes = dict(self.changes)
        for h, tier in other.changes.items():
            if h not in changes or rank[tier] > rank[changes[h]]:
                changes[h] = tier
        read = {k: _slowest(self.read_gbps.get(k), other.read_gbps.get(k))
                for k in {*self.read_gbps, *other.read_gbps}}
        tps = _slowest(self.prefill_tokens_per_second, other.prefill_tokens_per_second)
        return OffloadWorkerMeta(changes, self.failed | other.failed, read, tps)


def _slowest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass
class _Tracked:
    """A running request as the scheduler side follows it."""

    request: Any
    block_ids: list[int]
    saved: int   # leading blocks stored already (or asked to be)


class OffloadScheduler:
    """The engine core's side: decides what to load and what to save."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig,
                 kv_cache_config: Any) -> None:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
        if len(groups) != 1:
            raise ConfigError(f"kvmove offload supports models with one KV cache group, got "
                              f"{len(groups)} (hybrid attention)")
        _log_to_vllm()
        self.layout = layout_of(vllm_config)
        self.block_size = self.layout.block_size
        self.load_policy = config.load_policy
        self._index: dict[int, str] = {}   # store key -> tier: the worker store's mirror
        self._read_gbps: dict[str, float | None] = {}
        self._prefill_tps: float | None = None
        self._plans: dict[str, tuple[int, list[int], tuple[str, ...]]] = {}
        self._loads: list[tuple[str, list[int], list[int]]] = []
        self._tracked: dict[str, _Tracked] = {}
        self.events = StoreEvents(vllm_config, self.block_size)   # vLLM's KV events

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load: the stored blocks after the computed ones that the measured rule
        says to load. Never the whole prompt: vLLM computes at least its last token."""
        if self.load_policy is LoadPolicy.NEVER or not self._index:
            return 0, False
        start = num_computed_tokens // self.block_size
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        keys, tiers = [], []
        for block_hash in request.block_hashes[start:limit]:
            tier = self._index.get(store_key(block_hash))
            if tier is None:
                break
            keys.append(store_key(block_hash))
            tiers.append(tier)
        if not keys:
            return 0, False
        # auto or always: the store's own words (never returned above)
        found = decide_load(tiers, self._read_gbps, self._prefill_tps, self.layout,
                            self.load_policy.value)
        logger.info("kvmove offload: request %s: %d stored blocks after %d computed tokens "
                    "(%s), load %d: est. load %s s, recompute %s s", request.request_id,
                    len(keys), num_computed_tokens, "/".join(sorted(set(tiers))),
                    found.load_blocks, _num(found.load_seconds), _num(found.recompute_seconds))
        self._plans[request.request_id] = (start, keys[:found.load_blocks],
                                           found.tiers[:found.load_blocks])
        return found.load_blocks * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Follows the request from here (its blocks), and queues its load if any."""
        block_ids = list(blocks.get_block_ids()[0])
        start, keys, _ = self._plans.pop(request.request_id, (0, [], ()))
        n = num_external_tokens // self.block_size
        if n:
            self._loads.append((request.request_id, keys[:n], block_ids[start:start + n]))
        # Blocks before start were vLLM's own prefix-cache hits: stored when first computed
        # (without a plan, start is 0: saving a stored block again only marks it used).
        self._tracked[request.request_id] = _Tracked(request, block_ids, start + n)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMeta:
        """This step's loads (queued by update_state_after_alloc) and saves (every block that
        the step fills, for each scheduled request)."""
        meta = OffloadMeta(self._loads, [], scheduler_output.total_num_scheduled_tokens)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                tracked.block_ids = list(new_ids[0])
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i] + scheduled[req_id])
        return meta

    def _plan_save(self, meta: OffloadMeta, req_id: str, computed_after: int) -> None:
        tracked = self._tracked[req_id]
        hashes = tracked.request.block_hashes
        full = min(computed_after // self.block_size, len(hashes), len(tracked.block_ids))
        if full <= tracked.saved:
            return
        keys = [store_key(h) for h in hashes[tracked.saved:full]]
        meta.saves.append((req_id, keys, tracked.block_ids[tracked.saved:full]))
        self.events.saving(tracked.request, tracked.saved, keys)
        tracked.saved = full

    def update_connector_output(self, connector_output: Any) -> None:
        """Applies the workers' report: the store's changes and the measurements."""
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, OffloadWorkerMeta):
            return
        for key, tier in report.changes.items():
            before = self._index.pop(key, None) if tier is None else self._index.get(key)
            if tier is not None:
                self._index[key] = tier
            self.events.changed(key, before, tier)
        for req_id in report.failed:  # vLLM rewound it: save what it computes again
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.saved = min(tracked.saved,
                                    tracked.request.num_computed_tokens // self.block_size)
        self._read_gbps.update(report.read_gbps)
        if report.prefill_tokens_per_second is not None:
            self._prefill_tps = report.prefill_tokens_per_second

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing to hold: saves finished within the steps that filled the blocks."""
        self._tracked.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        return False, None

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return (0,)

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[Any]:
        """vLLM's KV events for what the store did since the last call (``kv_events.py``)."""
        return self.events.take()

    def shutdown(self) -> None:
        self._tracked.clear()


class OffloadWorker:
    """The worker's side: owns the store, moves blocks between it and vLLM's KV tensors."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig,
                 kv_cache_config: Any) -> None:
        _log_to_vllm()
        self.config = config
        self.layout = layout_of(vllm_config)
        self.namespace = _namespace(vllm_config, config)
        self.timeout = float(config.load_timeout)
        self.store: kvmove.KVStore | None = None
        self.cache: kvmove.KVCache | None = None
        self._meta: OffloadMeta | None = None
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()      # requests whose load failed this step
        self._reported_failed: set[str] = set()   # ... for the scheduler's next report
        self._step_start: float | None = None
        self._read_gbps: dict[str, float | None] = {}
        self._tps: float | None = None
        self.tally = Tally()   # what vLLM's metrics show (get_kv_connector_stats)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Wraps vLLM's KV tensors, zero-copy, whatever its backend's layout
        (``config.wrap_kv_caches``), and opens the store's tiers here, beside them, in that
        layout's block order."""
        self.cache = wrap_kv_caches(kv_caches, self.layout)
        with unpinned():   # the tiers' and the store's threads (see kvmove.runtime.unpinned)
            tiers: list[Any] = [kvmove.HostTier(int(self.config.store_host_gb * _GB))]
            if self.config.store_disk_dir is not None:
                path = self.config.store_disk_dir
                if self.config.tp_size > 1:
                    path = os.path.join(path, f"rank{self.config.tp_rank}")
                tiers.append(kvmove.DiskTier(path, int(self.config.store_disk_gb * _GB)))
            # the store keeps blocks in the order vLLM's backend holds them (a disk tier of
            # one order refuses another's: KVStore's fingerprint)
            self.store = kvmove.KVStore(self.layout, tiers, namespace=self.namespace,
                                        order=self.cache.order)
        logger.info("kvmove offload: %r over %d vLLM blocks", self.store, self.cache.num_blocks)

    def start_load_kv(self, meta: Any) -> None:
        """Brings this step's stored blocks into vLLM's; the first block missing or corrupt
        and those after it in its request become load errors (vLLM recomputes them)."""
        self._meta = meta if isinstance(meta, OffloadMeta) else None
        if self._meta is None or not self._meta.loads or self.store is None or self.cache is None:
            return
        start = time.perf_counter()
        handles = [(job, self.store.get(job[1], self.cache, job[2])) for job in self._meta.loads]
        for (req_id, _keys, ids), handle in handles:
            arrived = self._wait(handle, f"loading {len(ids)} blocks of request {req_id}")
            self.tally.count("offload_blocks_loaded", arrived)
            if arrived < len(ids):
                self._load_errors.update(ids[arrived:])
                self._failed.add(req_id)
                self.tally.count("offload_blocks_failed", len(ids) - arrived)
            logger.info("kvmove offload: loaded %d of %d blocks (%d tokens, %d bytes) of "
                        "request %s", arrived, len(ids), arrived * self.layout.block_size,
                        arrived * self.layout.bytes_per_block, req_id)
        logger.debug("kvmove offload: loads took %.3f s", time.perf_counter() - start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finished in start_load_kv; the first layer marks the forward's start."""
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: Any) -> None:
        """Nothing per layer: whole blocks (every layer) are saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Stores the blocks this step filled (not those of a request whose load failed:
        they were computed over KV vLLM is about to recompute), and records the step's
        prefill throughput."""
        meta, self._meta = self._meta, None
        started, self._step_start = self._step_start, None
        if meta is None or self.store is None or self.cache is None:
            return
        if started is not None and meta.num_tokens >= self.layout.block_size:
            self.store.observe_prefill(meta.num_tokens, time.perf_counter() - started)
        saves = [job for job in meta.saves if job[0] not in self._failed]
        self._reported_failed |= self._failed
        self._failed.clear()
        if not saves:
            return
        keys = [k for job in saves for k in job[1]]
        ids = [i for job in saves for i in job[2]]
        stored = self._wait(self.store.put(keys, self.cache, ids), f"storing {len(ids)} blocks")
        self.tally.count("offload_blocks_stored", stored)

    def _wait(self, handle: Any, what: str) -> int:
        try:
            return handle.wait(self.timeout)
        except TimeoutError:
            raise TimeoutError(f"kvmove offload: {what} took over load_timeout = "
                               f"{self.timeout:g} s; failing the step rather than letting "
                               "vLLM reuse blocks the store may still copy") from None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        return None, None   # loads and saves are synchronous: nothing finishes later

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> OffloadWorkerMeta | None:
        """What changed in the store this step, and the measurements when they moved."""
        if self.store is None:
            return None
        stats = self.store.stats()
        read = {name: tier.read_gbps for name, tier in stats.tiers.items()}
        changes = self.store.take_changes()
        tps = stats.prefill_tokens_per_second
        failed, self._reported_failed = self._reported_failed, set()
        if not changes and not failed and read == self._read_gbps and tps == self._tps:
            return None
        self._read_gbps, self._tps = read, tps
        return OffloadWorkerMeta(changes, failed, read, tps)

    def take_stats(self) -> dict[str, Any] | None:
        """The store's loads and saves since the last call (``tally.py``)."""
        return self.tally.take()

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close(timeout=self.timeout)
            self.store = None


def _namespace(vllm_config: Any, config: Any) -> str:
    """What else makes equal block hashes give equal KV in a disk tier that outlives this
    process: the model, its revision, the hash function, the tensor-parallel share."""
    model = vllm_config.model_config
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "")
    return (f"{model.model}@{model.revision or ''}|{algo}|"
            f"tp{config.tp_rank}/{config.tp_size}")


def _num(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.4f}"


def _log_to_vllm() -> None:
    """vLLM's processes log through the ``vllm`` logger's handlers only: lend them to this
    module's logger (at info unless KVMOVE_LOG_LEVEL says otherwise), so the connector's
    lines appear in the server's log beside vLLM's."""
    ours = logging.getLogger(__name__)
    if ours.handlers or logging.getLogger("kvmove").handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    if "KVMOVE_LOG_LEVEL" not in os.environ:
        ours.setLevel(logging.INFO)
    ours.propagate = not ours.handlers
