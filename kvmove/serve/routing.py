"""The router's placement among prefill (colocated) workers: ``--routing kv`` or
``least-loaded``, over the KV index the workers' events keep (``kv_index.py`` says how the
choice is made). The router keeps the index whatever the routing, so that
``kvmove_routing_matched_tokens`` compares the two on one workload."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvmove.auth import key_from_file, resolve_key
from kvmove.block_pool import prefix_hashes
from kvmove.serve.config import ServeConfig
from kvmove.serve.kv_index import Candidate, Decision, KVIndex, choose, least_loaded
from kvmove.serve.messages import KVEvents
from kvmove.serve.server_metrics import ServerMetrics

if TYPE_CHECKING:
    from kvmove.serve.handle import Handle
    from kvmove.serve.workers import WorkerInfo

__all__ = ["Routing"]


class Routing:
    def __init__(self, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.config, self.metrics = config, metrics
        self.index = KVIndex()
        key = key_from_file(config.key_file) if config.key_file else resolve_key()
        self.seed = key.prefix_seed()  # the workers' own (worker_main): equal hashes
        # Chosen and not yet placed (disaggregated: while the decode worker reserves blocks):
        # counted on their worker, or a burst of requests would all pick the same one.
        self._placing: dict[str, set[Handle]] = {}

    def on_events(self, worker: WorkerInfo, event: KVEvents) -> None:
        self.index.apply(worker.name, event)
        self._export(worker.name)

    def forget(self, worker: WorkerInfo) -> None:
        """Its process died, or a new one registered: its cache is gone."""
        self.index.remove_worker(worker.name)
        self._export(worker.name)

    def _export(self, name: str) -> None:
        for medium in ("cache", "store"):
            self.metrics.indexed.labels(worker=name, medium=medium).set(
                self.index.num_blocks(name, medium))

    def pick(self, handle: Handle, workers: Sequence[WorkerInfo],
             handles: Mapping[str, Handle]) -> tuple[WorkerInfo, Decision]:
        """The worker for ``handle`` among ``workers`` (live, ready, of one pool); counted on
        it until ``record`` or ``release``."""
        self.release(handle)
        hashes = handle.hashes = prefix_hashes(handle.prompt, self.config.block_size, self.seed)
        candidates = [self._candidate(w, hashes, handles) for w in workers]
        decide = choose if self.config.routing == "kv" else least_loaded
        decision = decide(candidates, len(handle.prompt))
        handle.uncached = decision.uncached_tokens
        self._placing.setdefault(decision.name, set()).add(handle)
        return next(w for w in workers if w.name == decision.name), decision

    def release(self, handle: Handle) -> None:
        """``handle`` is no longer being placed (placed, or failed)."""
        for placing in self._placing.values():
            placing.discard(handle)

    def record(self, handle: Handle, decision: Decision) -> None:
        """The request was placed as ``decision`` says: counted, and its prefill is pending
        work on its worker until its first token."""
        self.release(handle)
        self.metrics.routed.labels(worker=decision.name, reason=decision.reason).inc()
        self.metrics.matched.observe(decision.matched_tokens)

    def _candidate(self, worker: WorkerInfo, hashes: list[int],
                   handles: Mapping[str, Handle]) -> Candidate:
        placing = self._placing.get(worker.name, set())
        placed = [h for rid in worker.requests if (h := handles.get(rid)) is not None]
        placed += [h for h in placing if h.rid not in worker.requests]
        coming = set().union(*(h.hashes for h in placed))
        blocks, stored = self.index.match(worker.name, hashes, coming)
        pending = sum(h.uncached for h in placed if h.last_token is None)
        size = self.config.block_size
        return Candidate(worker.name, cached_tokens=(blocks - stored) * size,
                         stored_tokens=stored * size, pending_tokens=pending,
                         load=worker.load + len(placing), waiting=worker.stat("waiting"))
