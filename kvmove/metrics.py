"""Prometheus metrics of kvmove's agents and stores, for an engine that embeds kvmove.

    from prometheus_client import REGISTRY
    from kvmove.metrics import KVMoveCollector

    REGISTRY.register(KVMoveCollector(agents=[agent], stores={"prefill": store}))

The collector reads ``Agent.stats()`` and ``KVStore.stats()`` when Prometheus scrapes: a
sample is the value at that moment, and nothing has to keep gauges in sync in between.
``kvmove-serve`` builds the same families from its workers' reports (``agent_families``,
``store_families``), so the names are the same wherever kvmove runs.

Prometheus's conventions: what only grows is a counter named ``..._total``; what goes up and
down is a gauge; units are base units in the name (``_bytes``, ``_seconds``). Rates are left
to PromQL: a tier's read bandwidth is
``rate(kvmove_store_read_bytes_total[1m]) / rate(kvmove_store_read_seconds_total[1m])``,
where the stores' own ``read_gbps`` is a moving average of their recent reads, not exported.

``prometheus-client`` stays optional for the core: it is imported when a collector collects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmove.agent import Agent, AgentStats
    from kvmove.store import KVStore
    from kvmove.store.store import StoreStats

__all__ = ["KVMoveCollector", "agent_families", "store_families"]

# AgentStats field -> (kind, help). Two are "now" values; the rest count since the agent started.
AGENT_METRICS = {
    "leases_granted": ("counter", "Leases granted (expect calls)."),
    "leases_active": ("gauge", "Leases granted and not yet released."),
    "blocks_quarantined": ("gauge", "Blocks of cancelled or expired leases whose sender has "
                           "not answered yet, or was cut off while its process lives (not "
                           "reusable until it answers or exits)."),
    "leases_quarantined": ("counter", "Leases whose sender was cut off while it could still "
                           "write them."),
    "leases_expired": ("counter", "Leases whose deadline passed before they completed."),
    "cancels_sent": ("counter", "Cancels sent to senders."),
    "senders_disconnected": ("counter", "Senders cut off for not answering a Cancel in time."),
    "messages_refused": ("counter", "Stream messages refused (no lease, another sender, "
                         "other blocks, a state that does not allow them)."),
    "begins_refused": ("counter", "Of the messages refused, senders told no (they wrote "
                       "nothing)."),
    "checksum_mismatches": ("counter", "Received blocks (per layer) whose bytes did not match."),
    "acks_missed": ("counter", "Sent Finals not acknowledged in time."),
    "unknown_senders": ("counter", "Messages and notifications from an endpoint that is no "
                        "peer's (dropped unheard)."),
    "messages_dropped": ("counter", "Messages dropped for their form: rendezvous, over the size "
                         "bound, or over a peer's notification queue cap."),
}

# TierStats field -> (metric name after kvmove_store_, help); all counters.
TIER_COUNTERS = {
    "hits": ("hits_total", "Blocks lookups found in the tier (the first tier holding each)."),
    "misses": ("misses_total", "Blocks lookups looked for in the tier and did not find."),
    "served": ("served_blocks_total", "Blocks loaded back from the tier."),
    "corrupt": ("corrupt_blocks_total", "Blocks that failed their checksum or could not be "
                "read: dropped, never served."),
    "stored": ("stored_blocks_total", "Blocks written to the tier (put, or demoted to it)."),
    "evicted": ("evicted_blocks_total", "Blocks pushed out of the tier (demoted, or dropped "
                "from the last)."),
    "write_errors": ("write_errors_total", "Writes that failed (a full disk): those blocks "
                     "were not stored."),
    "bytes_read": ("read_bytes_total", "Bytes read from the tier."),
    "bytes_written": ("written_bytes_total", "Bytes written to the tier."),
    "read_seconds": ("read_seconds_total", "Seconds spent reading from the tier."),
    "write_seconds": ("write_seconds_total", "Seconds spent writing to the tier."),
}


def _families() -> tuple[type, type]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return CounterMetricFamily, GaugeMetricFamily


def agent_families(stats: Mapping[str, AgentStats], label: str = "agent") -> list[Any]:
    """One metric family per ``AgentStats`` field (``kvmove_agent_<field>``, ``_total`` for
    counters), a sample per agent labelled ``label``=name."""
    counter, gauge = _families()
    out = []
    for key, (kind, text) in AGENT_METRICS.items():
        family = (counter(f"kvmove_agent_{key}", text, labels=[label]) if kind == "counter"
                  else gauge(f"kvmove_agent_{key}", text, labels=[label]))
        for name, values in stats.items():
            family.add_metric([name], getattr(values, key))
        out.append(family)
    return out


def store_families(stats: Mapping[str, StoreStats], label: str = "store") -> list[Any]:
    """A store's tiers (``kvmove_store_blocks`` and ``_capacity_blocks`` gauges, and
    ``TIER_COUNTERS``, labelled ``label`` and ``tier``) and its lookups
    (``kvmove_store_lookups_total``, ``_lookup_misses_total``, ``_decisions_total`` by
    load-or-recompute decision)."""
    counter, gauge = _families()
    tiers = [label, "tier"]
    blocks = gauge("kvmove_store_blocks", "KV blocks held.", labels=tiers)
    capacity = gauge("kvmove_store_capacity_blocks", "KV blocks the tier can hold.",
                     labels=tiers)
    counters = {key: counter(f"kvmove_store_{name}", text, labels=tiers)
                for key, (name, text) in TIER_COUNTERS.items()}
    lookups = counter("kvmove_store_lookups", "Store lookups.", labels=[label])
    misses = counter("kvmove_store_lookup_misses", "Blocks asked for that no tier held.",
                     labels=[label])
    decisions = counter("kvmove_store_decisions", "Lookups by load-or-recompute decision.",
                        labels=[label, "decision"])
    for name, s in stats.items():
        for tier, values in s.tiers.items():
            blocks.add_metric([name, tier], s.blocks[tier])
            capacity.add_metric([name, tier], s.capacity_blocks[tier])
            for key, family in counters.items():
                family.add_metric([name, tier], getattr(values, key))
        lookups.add_metric([name], s.lookups)
        misses.add_metric([name], s.lookup_misses)
        for decision, count in s.decisions.items():
            decisions.add_metric([name, decision], count)
    return [blocks, capacity, *counters.values(), lookups, misses, decisions]


class KVMoveCollector:
    """A Prometheus collector of agents' and stores' counters, read at scrape time.

    Args:
        agents: agents, labelled ``agent`` by their names (or a mapping name -> agent);
            closed ones are skipped.
        stores: stores, labelled ``store`` by the mapping's keys (or by their index in a
            sequence).
    """

    def __init__(self, agents: Iterable[Agent] | Mapping[str, Agent] = (),
                 stores: Iterable[KVStore] | Mapping[str, KVStore] = ()) -> None:
        self._agents = dict(agents) if isinstance(agents, Mapping) else {
            a.name: a for a in agents}
        self._stores = dict(stores) if isinstance(stores, Mapping) else {
            str(i): s for i, s in enumerate(stores)}

    def collect(self) -> Iterator[Any]:
        yield from agent_families({n: a.stats() for n, a in self._agents.items()
                                   if not a.closed})
        yield from store_families({n: s.stats() for n, s in self._stores.items()})

    def describe(self) -> Iterator[Any]:
        """The families without samples (what registering checks names against)."""
        yield from agent_families({})
        yield from store_families({})

    def __repr__(self) -> str:
        return f"KVMoveCollector(agents={list(self._agents)}, stores={list(self._stores)})"

