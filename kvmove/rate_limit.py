"""Token buckets: one, and one per source (the metadata listener's, ``bootstrap.py``)."""

from __future__ import annotations

import time

__all__ = ["MAX_SOURCES", "PerSource", "RateLimit"]

MAX_SOURCES = 4096  # buckets kept before the idle ones are forgotten


class RateLimit:
    """A token bucket: ``rate`` events a second, bursts up to ``rate``."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.last = rate, rate, time.monotonic()

    def allow(self) -> bool:
        self._refill()
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def full(self) -> bool:
        """True once refilled: as good as a new bucket."""
        self._refill()
        return self.tokens >= self.rate

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now


class PerSource:
    """A ``RateLimit`` per source. Past ``MAX_SOURCES`` sources, the full buckets are
    forgotten (a full bucket is a new one): the map holds the sources of the last second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.buckets: dict[str, RateLimit] = {}

    def allow(self, source: str) -> bool:
        bucket = self.buckets.get(source)
        if bucket is None:
            if len(self.buckets) >= MAX_SOURCES:
                self.buckets = {s: b for s, b in self.buckets.items() if not b.full()}
            bucket = self.buckets[source] = RateLimit(self.rate)
        return bucket.allow()
