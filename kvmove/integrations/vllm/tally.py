"""What one worker's connector did since vLLM last asked: the data of its
``KVConnectorStats`` (``stats.py``), counted here without vLLM so that the P/D and offload
parts (tested without vLLM) count into it.

vLLM asks each worker for its stats after every step (``get_kv_connector_stats``), adds the
ranks' and the steps' together (``KVMoveConnectorStats.aggregate``), logs them every few
seconds and exports them as Prometheus metrics (``vllm:kvmove_*``, docs/vllm.md
"Observability"). The data is a plain dict, as vLLM sends it from the worker to the engine
core:

* ``load_seconds`` / ``load_bytes``: one entry per completed hand-off on a decode (offered
  until every layer of every prefill rank landed), ``send_seconds`` / ``send_bytes`` one per
  completed send on a prefill (its last layer posted until the decode acknowledged it);
* ``failed_loads`` / ``failed_sends``: hand-offs that failed (the decode recomputes);
* ``offload_blocks_loaded`` / ``offload_blocks_stored`` / ``offload_blocks_failed``: the
  store's blocks brought into vLLM's, stored from them, and asked for but missing or corrupt;
* ``checksum_mismatches``, ``leases_expired``, ``leases_quarantined``: what the worker's agents
  counted meanwhile (``AgentStats``);
* ``blocks_quarantined``: blocks held back now, waiting for a sender that may still write
  them (docs/streaming.md, "Quarantine"): the worker's agents' sum; over ranks and steps
  the largest.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from kvmove.agent_stats import AgentStats

__all__ = ["AGENT_COUNTERS", "COUNTS", "PEAKS", "SERIES", "Tally", "merge", "new_data"]

SERIES = ("load_seconds", "load_bytes", "send_seconds", "send_bytes")
COUNTS = ("failed_loads", "failed_sends", "offload_blocks_loaded", "offload_blocks_stored",
          "offload_blocks_failed", "checksum_mismatches", "leases_expired",
          "leases_quarantined")
PEAKS = ("blocks_quarantined",)
AGENT_COUNTERS = ("checksum_mismatches", "leases_expired", "leases_quarantined")


def new_data() -> dict[str, Any]:
    """An empty interval."""
    return {**{name: [] for name in SERIES}, **{name: 0 for name in COUNTS + PEAKS}}


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other`` added to ``into`` (series joined, counts summed, peaks the larger)."""
    for name in SERIES:
        into[name].extend(other.get(name, ()))
    for name in COUNTS:
        into[name] += other.get(name, 0)
    for name in PEAKS:
        into[name] = max(into[name], other.get(name, 0))
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(name) for name in SERIES + COUNTS + PEAKS)


class Tally:
    """One worker's counts since the last ``take``; thread-safe (the P/D parts count from
    their pool threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = new_data()
        self._seen: dict[str, AgentStats] = {}   # each agent's counters at the last take
        self._quarantined = 0                     # blocks_quarantined at the last take

    def loaded(self, nbytes: int, seconds: float) -> None:
        self._add(load_bytes=nbytes, load_seconds=seconds)

    def sent(self, nbytes: int, seconds: float) -> None:
        self._add(send_bytes=nbytes, send_seconds=seconds)

    def count(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to one of ``COUNTS``."""
        assert name in COUNTS, name
        with self._lock:
            self._data[name] += n

    def _add(self, **entries: float) -> None:
        with self._lock:
            for name, value in entries.items():
                self._data[name].append(value)

    def take(self, agents: Iterable[Any] = ()) -> dict[str, Any] | None:
        """The interval's data, the agents' counters added as the change since the last take
        (None when nothing happened; an interval whose only news is that the quarantine
        emptied is reported, so that the gauge goes back to 0); starts a new interval."""
        now = {agent.name: agent.stats() for agent in agents}
        with self._lock:
            data, self._data = self._data, new_data()
            for name, stats in now.items():
                before = self._seen.get(name)
                for counter in AGENT_COUNTERS:
                    data[counter] += getattr(stats, counter) - (
                        getattr(before, counter) if before is not None else 0)
            data["blocks_quarantined"] = sum(stats.blocks_quarantined for stats in now.values())
            self._seen.update(now)
            changed = data["blocks_quarantined"] != self._quarantined
            self._quarantined = data["blocks_quarantined"]
        return None if is_empty(data) and not changed else data
