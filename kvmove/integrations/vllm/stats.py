"""kvmove's connector in vLLM's own metrics: ``KVMoveConnectorStats`` (vLLM's
``KVConnectorStats``: logged as "KV Transfer metrics: ..." every few seconds) and
``KVMovePromMetrics`` (``vllm:kvmove_*`` on vLLM's ``/metrics``), from the data each worker
counts (``tally.py``, where the fields are explained).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvmove.integrations.vllm.tally import COUNTS, PEAKS, is_empty, merge, new_data

__all__ = ["KVMoveConnectorStats", "KVMovePromMetrics"]

_MB = 1e6


@dataclass
class KVMoveConnectorStats(KVConnectorStats):
    """One interval of kvmove's connector, over every rank of an engine."""

    data: dict[str, Any] = field(default_factory=dict)   # tally.py's (vLLM's field, typed)

    def __post_init__(self) -> None:
        self.data = merge(new_data(), self.data or {})

    def reset(self) -> None:
        self.data = new_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return is_empty(self.data)

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few figures, for vLLM's log line."""
        data = self.data
        out: dict[str, int | float] = {}
        for side in ("load", "send"):
            seconds, nbytes = data[f"{side}_seconds"], data[f"{side}_bytes"]
            if seconds:
                out[f"{side}s"] = len(seconds)
                out[f"avg {side} ms"] = round(1e3 * sum(seconds) / len(seconds), 3)
                out[f"{side} MB"] = round(sum(nbytes) / _MB, 3)
        out.update((name, data[name]) for name in COUNTS + PEAKS if data[name])
        return out


# Hand-off times from a block of a tiny model on loopback (~1 ms) to a large prompt across
# hosts (seconds), and sizes from one block to a long prompt of a large model.
_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_BYTES = [float(1 << (12 + 2 * i)) for i in range(12)]    # 4 KiB .. 16 GiB


class KVMovePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvmove_*``: hand-off time and size histograms (per side), and counters."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: Any, name: str, doc: str, **kw: Any) -> dict[int, Any]:
            return create_metric_per_engine(
                cls(name=f"vllm:kvmove_{name}", documentation=doc, labelnames=labelnames,
                    **kw), self.per_engine_labelvalues)

        hist, counter, gauge = self._histogram_cls, self._counter_cls, self._gauge_cls
        self.histograms = {
            "load_seconds": per_engine(hist, "load_seconds", "kvmove hand-offs on a decode: "
                                       "seconds from the offer until every layer landed",
                                       buckets=_SECONDS),
            "send_seconds": per_engine(hist, "send_seconds", "kvmove sends on a prefill: "
                                       "seconds from the last layer posted until acknowledged",
                                       buckets=_SECONDS),
            "load_bytes": per_engine(hist, "load_bytes", "bytes of each kvmove hand-off "
                                     "loaded on a decode", buckets=_BYTES),
            "send_bytes": per_engine(hist, "send_bytes", "bytes of each kvmove send on a "
                                     "prefill", buckets=_BYTES),
        }
        self.counters = {name: per_engine(counter, name, _COUNTER_DOCS[name])
                         for name in COUNTS}
        self.gauges = {name: per_engine(gauge, name, _GAUGE_DOCS[name]) for name in PEAKS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, metrics in self.histograms.items():
            for value in transfer_stats_data.get(name, ()):
                metrics[engine_idx].observe(value)
        for name, metrics in self.counters.items():
            if transfer_stats_data.get(name):
                metrics[engine_idx].inc(transfer_stats_data[name])
        for name, metrics in self.gauges.items():
            metrics[engine_idx].set(transfer_stats_data.get(name, 0))


_COUNTER_DOCS = {
    "failed_loads": "kvmove hand-offs that failed on a decode (the request was recomputed)",
    "failed_sends": "kvmove sends that failed on a prefill",
    "offload_blocks_loaded": "blocks loaded from kvmove's store into vLLM's KV cache",
    "offload_blocks_stored": "blocks stored from vLLM's KV cache into kvmove's store",
    "offload_blocks_failed": "blocks asked of kvmove's store but missing or corrupt "
                             "(recomputed)",
    "checksum_mismatches": "received KV blocks (per layer) whose checksum did not match",
    "leases_expired": "kvmove leases whose deadline passed before their KV arrived",
    "leases_quarantined": "kvmove leases whose sender was cut off while it could still write",
}
_GAUGE_DOCS = {
    "blocks_quarantined": "KV blocks held back until a cut-off sender can no longer write them",
}
