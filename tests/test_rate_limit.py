"""``kvmove/rate_limit.py``: the metadata listener's token buckets (issue 28, row 3)."""

from __future__ import annotations

import time

from kvmove.rate_limit import MAX_SOURCES, PerSource, RateLimit


def test_a_bucket_allows_its_burst_then_refuses_until_it_refills():
    bucket = RateLimit(10)
    assert [bucket.allow() for _ in range(11)] == [True] * 10 + [False]
    assert not bucket.full()
    time.sleep(0.15)  # 1.5 tokens
    assert bucket.allow() and not bucket.allow()


def test_each_source_has_a_budget_of_its_own():
    limit = PerSource(3)
    assert [limit.allow("10.0.0.1") for _ in range(4)] == [True, True, True, False]
    assert limit.allow("10.0.0.2"), "one source's flood spent another's budget"


def test_past_max_sources_the_idle_sources_are_forgotten():
    """A full bucket is as good as a new one: only the sources of the last moment are kept."""
    limit = PerSource(1e6)  # refilled within microseconds
    for i in range(MAX_SOURCES):
        assert limit.allow(f"idle-{i}")
    time.sleep(0.01)
    assert limit.allow("new")
    assert list(limit.buckets) == ["new"]
