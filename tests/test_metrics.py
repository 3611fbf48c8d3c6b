"""``kvmove/metrics.py``: ``KVMoveCollector`` exports what ``Agent.stats()`` and
``KVStore.stats()`` say at scrape time, as Prometheus types and names (read back with
``prometheus_client``'s own parser); ``kvmove-serve``'s ``/metrics`` is checked in
``test_serve.py``."""

from __future__ import annotations

from dataclasses import fields

import pytest

import kvmove
from kvmove.metrics import AGENT_METRICS, TIER_COUNTERS, KVMoveCollector

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

LAYOUT = kvmove.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                         block_size=4)


def _scrape(registry: object) -> dict[str, object]:
    text = prometheus_client.generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family: object, **labels: str) -> float:
    return next(s.value for s in family.samples
                if s.labels == labels and not s.name.endswith("_created"))


def test_every_agent_stat_is_exported_as_its_kind() -> None:
    assert set(AGENT_METRICS) == {f.name for f in fields(kvmove.AgentStats)}
    assert set(TIER_COUNTERS) | {"read_gbps", "write_gbps"} == {
        f.name for f in fields(kvmove.store.tiers.TierStats)}  # rates: left to PromQL


def test_the_collector_reads_stats_at_scrape_time() -> None:
    """A store that stores and serves blocks between two scrapes: the second scrape has the
    new counts, typed as counters (``_total``), the sizes as gauges, bytes and seconds in
    base units; an agent's stats likewise."""
    registry = prometheus_client.CollectorRegistry()
    cache = kvmove.KVCache(LAYOUT, 8)
    with kvmove.Agent("prefill-a", cache) as agent, \
            kvmove.KVStore(LAYOUT, [kvmove.HostTier(1 << 20)]) as store:
        registry.register(KVMoveCollector(agents=[agent], stores={"prefill": store}))
        before = _scrape(registry)
        assert _value(before["kvmove_store_stored_blocks"], store="prefill", tier="host") == 0
        hashes = kvmove.block_hashes(list(range(12)), LAYOUT.block_size)
        assert store.put(hashes, cache, [0, 1, 2]).wait(10.0) == 3
        assert store.get(hashes, cache, [3, 4, 5]).wait(10.0) == 3
        after = _scrape(registry)
        stats = store.stats()
        assert agent.stats().leases_granted == 0
    tier = {"store": "prefill", "tier": "host"}
    types = {name: family.type for name, family in after.items()}
    assert types["kvmove_store_stored_blocks"] == "counter"
    assert _value(after["kvmove_store_stored_blocks"], **tier) == 3
    assert _value(after["kvmove_store_served_blocks"], **tier) == 3
    assert _value(after["kvmove_store_written_bytes"], **tier) == \
        stats.tiers["host"].bytes_written == 3 * LAYOUT.bytes_per_block
    assert _value(after["kvmove_store_read_seconds"], **tier) == stats.tiers["host"].read_seconds
    assert types["kvmove_store_blocks"] == types["kvmove_store_capacity_blocks"] == "gauge"
    assert _value(after["kvmove_store_blocks"], **tier) == 3
    assert types["kvmove_agent_leases_granted"] == "counter"
    assert types["kvmove_agent_leases_active"] == "gauge"
    assert _value(after["kvmove_agent_leases_active"], agent="prefill-a") == 0
    for family in after.values():  # Prometheus's naming: counters _total, no rate gauges
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {f"{family.name}_total",
                                                        f"{family.name}_created"}
        assert "gbps" not in family.name and "per_second" not in family.name


def test_closed_agents_are_skipped_and_describe_has_no_samples() -> None:
    registry = prometheus_client.CollectorRegistry()
    agent = kvmove.Agent("gone", kvmove.KVCache(LAYOUT, 2))
    collector = KVMoveCollector(agents={"gone": agent})
    registry.register(collector)
    agent.close()
    assert not _scrape(registry)["kvmove_agent_leases_active"].samples
    assert all(not family.samples for family in collector.describe())
