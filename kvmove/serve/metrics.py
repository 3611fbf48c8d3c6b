"""The router's Prometheus metrics, in their own registry (one per router)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)


# A worker's kvmove agent (Agent.stats(), sent with its stats): leases and what they refused.
AGENT_GAUGES = {
    "leases_active": "Leases granted and not yet released.",
    "blocks_quarantined": "Blocks of cancelled leases whose sender has not answered yet.",
    "leases_expired": "Leases whose deadline passed before they completed.",
    "cancels_sent": "Cancels sent to senders.",
    "senders_disconnected": "Senders cut off for not answering a Cancel in time.",
    "messages_refused": "Stream messages refused (no lease, another sender, other blocks).",
    "checksum_mismatches": "Received blocks (per layer) whose bytes did not match.",
    "acks_missed": "Sent Finals not acknowledged in time.",
}


class Metrics:
    def __init__(self) -> None:
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
        self.agent = {key: Gauge(f"kvmove_agent_{key}", text, ["worker"], registry=r)
                      for key, text in AGENT_GAUGES.items()}
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
        self.kv_share = Histogram("kvmove_kv_transfer_ttft_share",
                                  "Exposed KV transfer time over the request's TTFT.",
                                  buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
                                  registry=r)
        self.requests = Counter("kvmove_requests", "Requests by outcome.", ["outcome"],
                                registry=r)
        self.tokens = Counter("kvmove_generated_tokens", "Tokens sent to clients.", registry=r)
        self.store = {key: Gauge(f"kvmove_store_{key}", text, ["worker", "tier"], registry=r)
                      for key, text in _STORE_TIER_GAUGES.items()}
        self.store_decisions = Gauge("kvmove_store_decisions",
                                     "Store lookups by load-or-recompute decision (since the "
                                     "worker started).", ["worker", "decision"], registry=r)
        self.store_prefill = Gauge("kvmove_store_prefill_tokens_per_second",
                                   "The prefill throughput the worker reports to its store "
                                   "(the recompute side of the decision).", ["worker"],
                                   registry=r)

    def set_store(self, worker: str, stats: dict) -> None:
        """A worker's store counters, as its last stats event gave them."""
        for tier, values in stats["tiers"].items():
            for key, gauge in self.store.items():
                if values.get(key) is not None:
                    gauge.labels(worker=worker, tier=tier).set(values[key])
        for decision, count in stats["decisions"].items():
            self.store_decisions.labels(worker=worker, decision=decision).set(count)
        if stats.get("prefill_tokens_per_second") is not None:
            self.store_prefill.labels(worker=worker).set(stats["prefill_tokens_per_second"])

    def set_agent(self, worker: str, stats: dict) -> None:
        for key, gauge in self.agent.items():
            if key in stats:
                gauge.labels(worker=worker).set(stats[key])


# KVStore counters exported per worker and tier (values since the worker started).
_STORE_TIER_GAUGES = {
    "blocks": "KV blocks held.",
    "capacity_blocks": "KV blocks the tier can hold.",
    "hits": "Blocks lookups found in the tier.",
    "misses": "Blocks lookups looked for in the tier and did not find.",
    "served": "Blocks loaded back from the tier.",
    "corrupt": "Blocks that failed their checksum: dropped, never served.",
    "evicted": "Blocks pushed out of the tier (demoted, or dropped from the last).",
    "write_errors": "Writes that failed (a full disk): those blocks were not stored.",
    "bytes_read": "Bytes read from the tier.",
    "bytes_written": "Bytes written to the tier.",
    "read_gbps": "Recent read bandwidth, GB/s (the load side of the decision).",
    "write_gbps": "Recent write bandwidth, GB/s.",
}
