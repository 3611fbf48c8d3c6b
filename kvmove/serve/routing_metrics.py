"""KV-aware routing's Prometheus families, one set of names for the own engine's router
(``server_metrics.py``) and the proxy in front of vLLM (``vllm/pools.py``). Apart from
``server_metrics`` so that the proxy, which runs without torch, imports nothing of the
engine's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["routing_families"]


def routing_families(r: CollectorRegistry) -> tuple[Counter, Histogram, Gauge]:
    """KV-aware routing's families (``routed``, ``matched``, ``indexed``), one set of names for
    the own engine's router and the proxy in front of vLLM (whose ``worker`` is an instance's
    URL)."""
    routed = Counter("kvmove_routing_decisions", "Requests placed on a prefill (colocated) "
                     "worker, by why: kv_hit (it holds the longest cached prefix), load (a "
                     "longer one is held by a busier worker), no_match (no worker holds any), "
                     "least_loaded (--routing least-loaded).", ["worker", "reason"],
                     registry=r)
    matched = Histogram("kvmove_routing_matched_tokens", "The prompt tokens the chosen "
                        "worker holds cached (or stored) when a request is placed, as its KV "
                        "events told the router.",
                        buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
    indexed = Gauge("kvmove_routing_indexed_blocks", "Block hashes the router's KV index "
                    "holds per worker and medium (cache: its live prefix cache, store: its "
                    "KVStore, or kvmove's tiers below vLLM).", ["worker", "medium"],
                    registry=r)
    return routed, matched, indexed
