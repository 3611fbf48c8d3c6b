"""The router's Prometheus metrics, in their own registry (one per router)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)


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
