"""``kvmove-bench stream``'s configuration and results, and their forms: what to measure, the
iterations a run produced as plain data (``to_dict`` is ``--json``), and the text and timeline
plot of them."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmove.agent import ERROR_MODES
from kvmove.bench.report import aligned, ms, pyplot, save_figure
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["MATMUL_N", "Iteration", "StreamConfig", "StreamReport", "format_stream",
           "layer_latency", "plot_stream"]

# One unit of simulated compute: a 96x96 float32 matmul, below OpenBLAS's threading threshold,
# so the "prefill" keeps to one core as a thread driving a GPU would, and leaves the others to
# the transport (a 256x256 one spreads over every core and starves UCX's threads).
MATMUL_N = 96


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """What ``run`` measures.

    Args:
        model: a ``KVSpec`` preset.
        num_tokens: prompt length; ``blocks_for(num_tokens)`` blocks move.
        block_size: tokens per block.
        transports / error_mode: as ``kvmove.Agent``.
        compute_ratio: per-layer compute time as a multiple of the measured per-layer transfer
            time (bulk transfer / layers), when ``compute_ms`` is None.
        compute_ms: per-layer compute time, fixed; overrides ``compute_ratio``.
        iters: timed iterations (after one warm-up); the report shows the median one.
        timeout: deadline in seconds of every wait.
        seed: for the data pattern.
        checksums: the streamed hand-off carries per-block checksums, which the receiver
            verifies as layers land (the bulk one moves the bytes alone).
    """

    model: str = "llama-3.1-8b"
    num_tokens: int = 4000
    block_size: int = 16
    transports: str | None = None
    error_mode: str = "peer"
    compute_ratio: float = 1.0
    compute_ms: float | None = None
    iters: int = 3
    timeout: float = 60.0
    seed: int = 0
    checksums: bool = False

    def __post_init__(self) -> None:
        for name in ("num_tokens", "iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        self.layout()  # validates model and block_size
        if self.error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        for name in ("compute_ratio", "compute_ms", "timeout"):
            value = getattr(self, name)
            if value is None and name == "compute_ms":
                continue
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}")

    def layout(self) -> KVSpec:
        return KVSpec.preset(self.model, block_size=self.block_size)

    @property
    def agent_kwargs(self) -> dict[str, Any]:
        return {"transports": self.transports, "error_mode": self.error_mode,
                "checksums": self.checksums}


@dataclass(frozen=True, slots=True)
class Iteration:
    """One bulk and one streamed hand-off, on the ``time.monotonic()`` clock.

    ``compute`` holds each layer's (start, end); ``transfer`` each layer's (posted, landed)
    as the sender saw it; ``arrived`` when the receiver got each layer's ready message.
    """

    bulk_compute_seconds: float
    bulk_transfer_seconds: float
    stream_compute_seconds: float
    stream_exposed_seconds: float
    receiver_exposed_seconds: float  # last layer's arrival at the receiver - last compute end
    save_layer_seconds: tuple[float, ...]
    compute: tuple[tuple[float, float], ...]
    transfer: tuple[tuple[float, float], ...]
    arrived: tuple[float, ...]
    mismatched_blocks: int

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.stream_exposed_seconds / self.bulk_transfer_seconds

    @property
    def layer_latency_seconds(self) -> float:
        """Median over layers of landed - posted: how long after its post a layer was in
        place (while the compute and other layers shared the machine)."""
        return layer_latency(self.transfer)

    @property
    def compute_slowdown(self) -> float:
        """Streamed prefill compute over bulk's: what sharing the machine with the transfer
        cost the compute (1.0 = nothing)."""
        return self.stream_compute_seconds / self.bulk_compute_seconds

    @property
    def speedup(self) -> float:
        """(bulk compute + transfer) over (streamed compute + exposed): the hand-off's end."""
        return ((self.bulk_compute_seconds + self.bulk_transfer_seconds) /
                (self.stream_compute_seconds + self.stream_exposed_seconds))


@dataclass(frozen=True, slots=True)
class StreamReport:
    """Everything one ``run`` measured; ``to_dict`` is ``kvmove-bench stream --json``."""

    config: StreamConfig
    num_layers: int
    num_blocks: int
    nbytes: int
    compute_ms_per_layer: float
    matmuls_per_layer: int
    iterations: tuple[Iteration, ...]
    wall_seconds: float
    warmup: Iteration = field(repr=False)

    @property
    def median(self) -> Iteration:
        """The iteration with the median hidden fraction (the lower one of an even count)."""
        ranked = sorted(self.iterations, key=lambda it: it.hidden_fraction)
        return ranked[(len(ranked) - 1) // 2]

    @property
    def verified(self) -> bool:
        return all(it.mismatched_blocks == 0 for it in (self.warmup, *self.iterations))

    @property
    def transfer_ms_per_layer(self) -> float:
        return self.median.bulk_transfer_seconds / self.num_layers * 1e3

    def to_dict(self) -> dict[str, Any]:
        m = self.median
        return {
            "config": asdict(self.config), "statistic": f"median of {self.config.iters} "
            "iterations (by hidden fraction) after 1 warm-up",
            "num_layers": self.num_layers, "num_blocks": self.num_blocks, "nbytes": self.nbytes,
            "bytes_per_layer": self.nbytes // self.num_layers,
            "compute_ms_per_layer": self.compute_ms_per_layer,
            "matmuls_per_layer": self.matmuls_per_layer,
            "transfer_ms_per_layer": self.transfer_ms_per_layer,
            "compute_over_transfer": self.compute_ms_per_layer / self.transfer_ms_per_layer,
            "layer_latency_ms": m.layer_latency_seconds * 1e3,
            "prefill_compute_ms": m.stream_compute_seconds * 1e3,
            "bulk_transfer_ms": m.bulk_transfer_seconds * 1e3,
            "exposed_ms": m.stream_exposed_seconds * 1e3,
            "receiver_exposed_ms": m.receiver_exposed_seconds * 1e3,
            "hidden_fraction": m.hidden_fraction,
            "bulk_compute_ms": m.bulk_compute_seconds * 1e3,
            "compute_slowdown": m.compute_slowdown, "speedup": m.speedup,
            "save_layer_us_mean": statistics.fmean(m.save_layer_seconds) * 1e6,
            "save_layer_us_max": max(m.save_layer_seconds) * 1e6,
            "verified": self.verified,
            "iterations": [{**asdict(it), "hidden_fraction": it.hidden_fraction,
                            "layer_latency_ms": it.layer_latency_seconds * 1e3,
                            "compute_slowdown": it.compute_slowdown, "speedup": it.speedup}
                           for it in self.iterations],
            "wall_seconds": self.wall_seconds,
        }


def layer_latency(transfer: tuple[tuple[float, float], ...]) -> float:
    """Median over layers of landed - posted."""
    return statistics.median(landed - posted for posted, landed in transfer)


# --- text and plot --------------------------------------------------------------------------

def format_stream(report: StreamReport) -> str:
    """Header, the compute, the bulk vs streamed table, and the save_layer overhead."""
    config, m = report.config, report.median
    layout = config.layout()
    transports = config.transports or "UCX's choice"
    per_layer = report.nbytes // report.num_layers
    chosen = (f"fixed at {config.compute_ms:g} ms" if config.compute_ms is not None else
              f"{config.compute_ratio:g} x the per-layer transfer time measured first")
    header = (
        f"{config.model} ({layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim "
        f"{layout.head_dim}, {layout.dtype}), {config.num_tokens:,} tokens: {report.num_blocks:,}"
        f" blocks, {per_layer:,} B per layer, {report.nbytes:,} B in all; transports "
        f"{transports}, error mode {config.error_mode}; median of {config.iters} iterations "
        f"(by hidden fraction) after a warm-up, every byte verified on the receiving side"
        + ("; the streamed hand-off carries per-block checksums, verified as layers land"
           if config.checksums else ""))
    ratio = report.compute_ms_per_layer / report.transfer_ms_per_layer
    compute = (f"simulated prefill: {report.matmuls_per_layer} float32 {MATMUL_N}x{MATMUL_N} "
               f"matmuls per layer, {report.compute_ms_per_layer:.2f} ms ({chosen})\n"
               f"transfer per layer: {report.transfer_ms_per_layer:.2f} ms in bulk; compute / "
               f"transfer = {ratio:.2f} (the target applies from 1); streamed, a layer "
               f"landed {m.layer_latency_seconds * 1e3:.2f} ms (median) after its post")
    head = ["", "bulk", "streamed"]
    rows = [
        ["prefill compute ms", ms(m.bulk_compute_seconds * 1e3),
         ms(m.stream_compute_seconds * 1e3)],
        ["transfer after the compute ms (exposed)", ms(m.bulk_transfer_seconds * 1e3),
         ms(m.stream_exposed_seconds * 1e3)],
        ["hand-off done after ms", ms((m.bulk_compute_seconds + m.bulk_transfer_seconds) * 1e3),
         ms((m.stream_compute_seconds + m.stream_exposed_seconds) * 1e3)],
    ]
    saves = m.save_layer_seconds
    mean_us = sum(saves) / len(saves) * 1e6
    lines = [
        f"hidden fraction: {m.hidden_fraction * 100:.1f}% of the bulk transfer (1 - exposed / "
        f"bulk; target >= 90% when per-layer compute >= per-layer transfer)",
        f"streamed hand-off done {m.speedup:.2f}x sooner; the compute ran "
        f"{m.compute_slowdown:.2f}x as long as in bulk (the transfer shares this machine's "
        "cores)",
        f"save_layer() call: mean {mean_us:.1f} us, max {max(saves) * 1e6:.1f} us "
        f"({mean_us / (report.compute_ms_per_layer * 1e3) * 100:.2f}% of a layer's compute)",
        f"receiver: last layer in {m.receiver_exposed_seconds * 1e3:.2f} ms after the last "
        "compute (same host, same clock)",
    ]
    return "\n".join([header, "", compute, "", *aligned(head, rows, left={0}), "", *lines,
                      "", f"measured in {report.wall_seconds:.1f} s"])


def plot_stream(report: StreamReport, path: str) -> None:
    """Timeline of the median iteration: per layer, compute and transfer, bulk vs streamed."""
    m = report.median
    t0 = m.compute[0][0]
    spans = [((start - t0) * 1e3, (end - start) * 1e3) for start, end in m.compute]
    fig, ax = pyplot().subplots(figsize=(10, 3.5))
    ax.broken_barh(spans, (30, 8), facecolors="tab:blue", edgecolor="white", linewidth=0.3)
    transfers = [((posted - t0) * 1e3, (landed - posted) * 1e3) for posted, landed in m.transfer
                 if posted is not None and landed is not None]
    ax.broken_barh(transfers, (20, 8), facecolors="tab:orange", edgecolor="white",
                   linewidth=0.3)
    bulk_compute = m.bulk_compute_seconds * 1e3
    ax.broken_barh([(0, bulk_compute)], (10, 8), facecolors="tab:blue", alpha=0.5)
    ax.broken_barh([(bulk_compute, m.bulk_transfer_seconds * 1e3)], (0, 8),
                   facecolors="tab:orange", alpha=0.5)
    end = (m.stream_compute_seconds + m.stream_exposed_seconds) * 1e3
    ax.axvline(end, color="tab:green", linestyle="--", label=f"streamed: done ({end:.0f} ms)")
    ax.axvline(bulk_compute + m.bulk_transfer_seconds * 1e3, color="tab:red", linestyle=":",
               label="bulk: done")
    ax.set_yticks([4, 14, 24, 34])
    ax.set_yticklabels(["bulk transfer", "bulk compute", "streamed: layer puts",
                        "streamed: layer compute"])
    ax.set_xlabel("ms since the first layer's compute started")
    ax.set_title(f"{report.config.model}, {report.config.num_tokens:,} tokens, "
                 f"{report.num_layers} layers: hidden {m.hidden_fraction * 100:.1f}% "
                 f"(transports {report.config.transports or 'by UCX'}, error mode "
                 f"{report.config.error_mode})")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)
