"""The vLLM instances ``kvmove-serve --vllm-prefill ... --vllm-decode ...`` fronts: the two
pools and their Prometheus metrics (``proxy.py`` speaks the protocol over them; the
configuration is ``proxy_config.py``'s).

A pool picks the instance with the fewest requests in flight, ties in turn (round robin): a
proxy sees every request it sends, so its own count is exact for instances it alone feeds and
costs no round trip, unlike asking vLLM for its queue. Each prefill instance also remembers
its kvmove address (``remote_engine_id``, ``remote_host``, ``remote_port``) from the last
``kv_transfer_params`` it returned: push mode cannot start without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmove.integrations.vllm.params import KVTransferParams
from kvmove.serve.routing_metrics import routing_families
from kvmove.serve.vllm.proxy_config import KV_MODES, ProxyConfig

__all__ = ["KV_MODES", "Instance", "Pool", "ProxyConfig", "ProxyMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)


@dataclass(eq=False)
class Instance:
    """One vLLM server: its URL, its pool, its requests in flight here and (prefill only)
    its kvmove address once it has told us."""

    url: str
    pool: str
    in_flight: int = 0
    address: KVTransferParams | None = None  # its engine id, host and port alone
    warned: bool = False  # said once that it returns no kv_transfer_params

    def learn_address(self, params: Any) -> None:
        """Remembers the kvmove address in a prefill's ``kv_transfer_params``, if it has one
        (a vLLM without the kvmove connector returns none, or null)."""
        address = KVTransferParams.from_request(params).prefill_address()
        if address is not None:
            self.address = address


@dataclass(eq=False)
class Pool:
    """The prefill or the decode instances."""

    name: str
    instances: list[Instance] = field(default_factory=list)
    _next: int = 0

    @classmethod
    def of(cls, name: str, urls: tuple[str, ...]) -> Pool:
        return cls(name, [Instance(url, name) for url in urls])

    def pick(self) -> Instance:
        """The instance with the fewest requests in flight; among equals, the first at or
        after the one after the last pick (round robin, so idle instances share the load)."""
        least = min(i.in_flight for i in self.instances)
        instance = next(i for i in self.rotation() if i.in_flight == least)
        self.picked(instance)
        return instance

    def rotation(self) -> list[Instance]:
        """The instances from the one after the last pick: ties broken in this order go
        round robin."""
        return self.instances[self._next:] + self.instances[:self._next]

    def picked(self, instance: Instance) -> None:
        self._next = (self.instances.index(instance) + 1) % len(self.instances)


class ProxyMetrics:
    """The proxy's Prometheus families, in their own registry (``docs/serving.md`` lists
    them). ``pending`` and ``rejected`` are the two ``admission.Admission`` records."""

    def __init__(self, pools: list[Pool]) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["pool", "instance"]
        self.requests = Counter("kvmove_proxy_requests", "Requests sent to an instance.",
                                labels, registry=r)
        self.in_flight = Gauge("kvmove_proxy_requests_in_flight",
                               "Requests sent to an instance and not finished.", labels,
                               registry=r)
        self.errors = Counter("kvmove_proxy_errors", "Failed upstream calls by kind: connect, "
                              "timeout, status (non-2xx), protocol (a malformed answer), stream "
                              "(broken mid-stream), no_kv_params (a prefill returned none).",
                              [*labels, "kind"], registry=r)
        self.latency = Histogram("kvmove_proxy_upstream_seconds", "An upstream call: request "
                                 "sent to its last byte received.", labels,
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("kvmove_proxy_upstream_ttfb_seconds", "An upstream call: "
                              "request sent to its first body byte (a stream's first chunk).",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.handoffs = Counter("kvmove_proxy_handoffs", "Completions by KV hand-off: push, "
                                "pull, or pull-fallback (push asked, the prefill's kvmove "
                                "address not known yet).", ["mode"], registry=r)
        self.pending = Gauge("kvmove_proxy_http_pending_requests",
                             "Completions admitted and not finished (at most --max-pending).",
                             registry=r)
        self.rejected = Counter("kvmove_proxy_http_rejected_requests", "Client requests "
                                "refused before any upstream call: malformed body (400), body "
                                "too large (413), too many pending (429), Host not allowed "
                                "(421).", ["status"], registry=r)
        self.routed, self.matched, self.indexed = routing_families(r)
        for pool in pools:  # every series from the start: rate() needs the zero
            for i in pool.instances:
                self.requests.labels(pool.name, i.url)
                self.in_flight.labels(pool.name, i.url)
        for mode in (*KV_MODES, "pull-fallback"):
            self.handoffs.labels(mode)
