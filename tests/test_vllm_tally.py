"""What the vLLM connector's workers count for vLLM's metrics (``tally.py``): no vLLM needed.
The end-to-end path (the counts in vLLM's ``/metrics``) is in test_vllm_connector.py and
test_vllm_events.py."""

from __future__ import annotations

import time

import pytest

import kvmove
from kvmove.integrations.vllm.tally import COUNTS, Tally, merge, new_data

LAYOUT = kvmove.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                       block_size=4)


@pytest.fixture
def pair():
    pre = kvmove.Agent("pre", kvmove.KVCache(LAYOUT, num_blocks=8))
    dec = kvmove.Agent("dec", kvmove.KVCache(LAYOUT, num_blocks=8))
    dec.connect(*pre.listen())
    pre.connect(*dec.listen())
    yield pre, dec
    dec.close()
    pre.close()


def test_an_idle_interval_is_none_and_each_interval_starts_empty():
    tally = Tally()
    assert tally.take() is None
    tally.loaded(4096, 0.002)
    tally.loaded(8192, 0.004)
    tally.count("failed_sends")
    data = tally.take()
    assert data is not None
    assert data["load_bytes"] == [4096, 8192] and data["load_seconds"] == [0.002, 0.004]
    assert data["failed_sends"] == 1 and data["send_seconds"] == []
    assert tally.take() is None


def test_only_known_counts_are_counted():
    with pytest.raises(AssertionError):
        Tally().count("no_such_count")
    assert set(new_data()) >= set(COUNTS)


def test_agents_counters_arrive_as_their_change(pair):
    """An expired lease is counted once, in the interval it happened in; the agent's
    counters since it started are not counted again."""
    _pre, dec = pair
    tally = Tally()
    assert tally.take([dec]) is None
    load = dec.expect("pre", "r1", [0, 1], timeout=0.2).start_load()
    with pytest.raises(kvmove.errors.TimeoutError):
        load.wait_all(timeout=5.0)
    deadline = time.monotonic() + 5.0
    while not load.released and time.monotonic() < deadline:
        time.sleep(0.01)
    data = tally.take([dec])
    assert data is not None and data["leases_expired"] == 1, data
    assert tally.take([dec]) is None


def test_merge_sums_counts_joins_series_and_keeps_the_peak():
    a = merge(new_data(), {"load_seconds": [0.1], "failed_loads": 2, "blocks_quarantined": 3})
    merge(a, {"load_seconds": [0.2], "failed_loads": 1, "blocks_quarantined": 1})
    assert a["load_seconds"] == [0.1, 0.2]
    assert a["failed_loads"] == 3 and a["blocks_quarantined"] == 3
