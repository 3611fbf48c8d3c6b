"""The router's Prometheus metrics, in their own registry (one per router).

Prometheus's conventions (``docs/serving.md`` lists every name): counters end in ``_total``,
units are base units (``_seconds``, ``_bytes``), a share is a ``_ratio``. The workers' agent
and store counters are exported as counters by a collector that reads, at scrape time, the
last stats each worker reported (every 0.1 s: ``Agent.stats()`` and ``KVStore.stats()`` in
the worker) through the same families ``kvmove.metrics`` gives an embedding engine, labelled
``worker``. A worker that restarts starts its counters at 0 again: a counter reset, which
Prometheus's ``rate()`` expects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from kvmove.metrics import agent_families, store_families
from kvmove.serve.messages import HANDOFF_STAGES, Ended, Timeline
from kvmove.serve.routing_metrics import routing_families

if TYPE_CHECKING:
    from kvmove.serve.pool import WorkerPool
    from kvmove.serve.workers import WorkerInfo

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)


class _WorkerCollector:
    """Every worker's agent and store counters, from its last stats event."""

    def __init__(self, workers: Mapping[str, WorkerInfo]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Any]:
        stats = {n: w.stats for n, w in self._workers.items() if w.stats is not None}
        yield from agent_families({n: s.agent for n, s in stats.items() if s.agent},
                                  label="worker")
        yield from store_families({n: s.store for n, s in stats.items() if s.store},
                                  label="worker")
        dropped = CounterMetricFamily(
            "kvmove_agent_notifications_dropped", "Agent notifications a worker drained "
            "unread (kvmove-serve uses none: a peer's are discarded).", labels=["worker"])
        for name, s in stats.items():
            dropped.add_metric([name], s.notifications_dropped)
        yield dropped


class ServerMetrics:
    """``kvmove-serve``'s families; ``docs/serving.md`` lists them with their labels."""

    def __init__(self, workers: Mapping[str, WorkerInfo]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvmove_ttft_seconds", "Time to first token, at the router.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvmove_itl_seconds", "Gaps between a request's tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Gauge("kvmove_pool_queue_length",
                           "Requests waiting per pool (decode: for blocks to land in, too).",
                           ["pool"], registry=r)
        self.running = Gauge("kvmove_pool_running", "Requests in the batch per pool.", ["pool"],
                             registry=r)
        self.free_blocks = Gauge("kvmove_worker_free_blocks", "Free KV blocks per worker.",
                                 ["worker"], registry=r)
        self.alive = Gauge("kvmove_worker_alive", "1 while the worker process runs.",
                           ["worker"], registry=r)
        self.restarts = Counter("kvmove_worker_restarts", "Worker processes started again "
                                "after they died.", ["worker"], registry=r)
        self.kv_bytes = Counter("kvmove_kv_bytes", "KV bytes handed from prefill to decode.",
                                registry=r)
        self.kv_seconds = Histogram("kvmove_kv_transfer_seconds",
                                    "A request's KV transfer: its first layer posted to its "
                                    "last layer landed in the decode worker's blocks.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_exposed = Histogram("kvmove_kv_exposed_seconds",
                                    "The part of the transfer after the prefill's last layer: "
                                    "its last layer posted to landed (what streaming leaves on "
                                    "TTFT).", buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_handoff = Histogram("kvmove_kv_handoff_seconds",
                                    "The KV hand-off on a request's TTFT: the prefill's last "
                                    "layer computed to the decode worker seeing the request's "
                                    "KV and first token in.", buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.kv_stages = Histogram("kvmove_kv_handoff_stage_seconds",
                                   "The KV hand-off's timeline: each stage's moment after the "
                                   "prefill's last layer was computed (sent: its bytes all "
                                   "landed; sampled: first token sampled, final message handed "
                                   "over; landed: the decode agent got the last layer's "
                                   "message; learned: the decode worker saw the load complete; "
                                   "first_step: its first decode step began).", ["stage"],
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_ratio = Histogram("kvmove_kv_handoff_ttft_ratio",
                                  "The KV hand-off's share of TTFT: kvmove_kv_handoff_seconds "
                                  "over the request's TTFT seconds.",
                                  buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
                                  registry=r)
        self.requests = Counter("kvmove_requests", "Requests by outcome.", ["outcome"],
                                registry=r)
        self.tokens = Counter("kvmove_generated_tokens", "Tokens sent to clients.", registry=r)
        self.pending = Gauge("kvmove_http_pending_requests",
                             "Completions admitted and not finished (at most --max-pending).",
                             registry=r)
        self.rejected = Counter("kvmove_http_rejected_requests",
                                "HTTP requests refused before the API: body too large (413), "
                                "too many pending (429), Host not allowed (421).",
                                ["status"], registry=r)
        self.control_dropped = Counter("kvmove_control_messages_dropped",
                                       "Control-channel messages the router dropped: from no "
                                       "live worker (unknown_peer), malformed, or that failed "
                                       "in handling (error).", ["reason"], registry=r)
        self.commands_refused = Counter("kvmove_control_commands_refused",
                                        "Router commands a worker answered with an error.",
                                        ["worker"], registry=r)
        self.routed, self.matched, self.indexed = routing_families(r)
        self.planner = Counter("kvmove_planner_decisions", "The planner's actions (--planner): "
                               "add or drain a worker of a pool, and why (below_min, "
                               "above_max, queue, utilisation, idle).",
                               ["pool", "action", "reason"], registry=r)
        self.workers = Gauge("kvmove_pool_workers", "Live workers per pool taking requests "
                             "or starting (not draining).", ["pool"], registry=r)
        r.register(_WorkerCollector(workers))

    def observe_pools(self, pool: WorkerPool) -> None:
        """The pools' gauges and each worker's free blocks, from their last stats."""
        for role in pool.config.pools():
            self.queue.labels(pool=role).set(pool.queue(role))
            self.running.labels(pool=role).set(pool.running(role))
            self.workers.labels(pool=role).set(len(pool.active(role)))
        for w in pool.values():
            if w.stats is not None:
                self.free_blocks.labels(worker=w.name).set(w.stats.free_blocks)

    def observe_handed_off(self, event: Ended) -> None:
        """A prefill worker's KV hand-off ended (its ack may come after the response)."""
        self.kv_bytes.inc(event.kv_bytes)
        self.observe_handoff(event.timeline, None)
        if event.kv_seconds is None or event.kv_exposed_seconds is None:
            return
        self.kv_seconds.observe(event.kv_seconds)
        self.kv_exposed.observe(event.kv_exposed_seconds)

    def observe_handoff(self, timeline: Timeline | None, ttft: float | None) -> None:
        """A worker's moments of a request's KV hand-off (``Ended.timeline``: the prefill's
        or the decode's, each with the prefill's ``last_layer``): each stage after the last
        layer; from the decode's, the hand-off's length and its share of ``ttft``. The
        moments are ``time.monotonic()`` of two processes of one boot: one clock."""
        if not timeline or (start := timeline.get("last_layer")) is None:
            return
        for stage in HANDOFF_STAGES[1:]:
            if stage in timeline:
                self.kv_stages.labels(stage).observe(timeline[stage] - start)
        learned = timeline.get("learned")
        if learned is not None:
            self.kv_handoff.observe(learned - start)
            if ttft:
                self.kv_ratio.observe((learned - start) / ttft)
