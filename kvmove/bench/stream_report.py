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

__all__ = ["COMPUTE_KINDS", "MATMUL_N", "Iteration", "StreamConfig", "StreamReport",
           "format_stream", "layer_latency", "plot_stream"]

# One unit of simulated compute: a 96x96 float32 matmul, below OpenBLAS's threading threshold,
# so the "prefill" keeps to one core as a thread driving a GPU would, and leaves the others to
# the transport (a 256x256 one spreads over every core and starves UCX's threads).
MATMUL_N = 96
# What stands in for the prefill's compute: matmuls on this host's CPU, or a timed wait (an
# accelerator's kernels, which leave the host's cores free).
COMPUTE_KINDS = ("cpu", "accelerator")


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
        checksums: both hand-offs carry per-block checksums, which the receiver verifies as
            layers land (the default, as ``kvmove.Agent``); each iteration then also streams
            without them, to show what they cost.
        compute: ``"cpu"`` (matmuls on one core) or ``"accelerator"`` (a timed wait).
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
    checksums: bool = True
    compute: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_tokens", "iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        self.layout()  # validates model and block_size
        if self.error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        if self.compute not in COMPUTE_KINDS:
            raise ConfigError(f"compute must be one of {COMPUTE_KINDS}, got {self.compute!r}")
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
    """One bulk and one streamed hand-off (and, with checksums, one streamed without them), on
    the ``time.monotonic()`` clock.

    ``compute`` holds each layer's (start, end); ``transfer`` each layer's (posted, landed)
    as the sender saw it; ``arrived`` when the receiver got each layer's ready message.
    ``plain_done_seconds``: compute + exposed of the streamed hand-off without checksums.
    """

    plain_done_seconds: float | None
    plain_mismatched_blocks: int
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
    def bulk_done_seconds(self) -> float:
        return self.bulk_compute_seconds + self.bulk_transfer_seconds

    @property
    def stream_done_seconds(self) -> float:
        return self.stream_compute_seconds + self.stream_exposed_seconds

    @property
    def speedup(self) -> float:
        """End to end: (bulk compute + transfer) over (streamed compute + exposed), when the
        decode has the KV. Below 1, streaming lost."""
        return self.bulk_done_seconds / self.stream_done_seconds

    @property
    def checksum_cost(self) -> float | None:
        """The streamed hand-off's end with checksums over without, minus 1 (None: off)."""
        if self.plain_done_seconds is None:
            return None
        return self.stream_done_seconds / self.plain_done_seconds - 1.0


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
        """The iteration with the median end-to-end speedup (the lower one of an even
        count)."""
        ranked = sorted(self.iterations, key=lambda it: it.speedup)
        return ranked[(len(ranked) - 1) // 2]

    @property
    def checksum_cost(self) -> float | None:
        """The streamed hand-off's end with checksums over without, minus 1: the medians over
        the iterations of each (None: checksums off)."""
        plain = [it.plain_done_seconds for it in self.iterations]
        if any(p is None for p in plain):
            return None
        return (statistics.median(it.stream_done_seconds for it in self.iterations) /
                statistics.median(p for p in plain if p is not None) - 1.0)

    @property
    def verified(self) -> bool:
        return all(it.mismatched_blocks == 0 and it.plain_mismatched_blocks == 0
                   for it in (self.warmup, *self.iterations))

    @property
    def transfer_ms_per_layer(self) -> float:
        return self.median.bulk_transfer_seconds / self.num_layers * 1e3

    def to_dict(self) -> dict[str, Any]:
        m = self.median
        return {
            "config": asdict(self.config), "statistic": f"median of {self.config.iters} "
            "iterations (by end-to-end speedup) after 1 warm-up",
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
            "bulk_done_ms": m.bulk_done_seconds * 1e3,
            "stream_done_ms": m.stream_done_seconds * 1e3,
            "checksum_cost": self.checksum_cost,
            "save_layer_us_mean": statistics.fmean(m.save_layer_seconds) * 1e6,
            "save_layer_us_max": max(m.save_layer_seconds) * 1e6,
            "verified": self.verified,
            "iterations": [{**asdict(it), "hidden_fraction": it.hidden_fraction,
                            "layer_latency_ms": it.layer_latency_seconds * 1e3,
                            "compute_slowdown": it.compute_slowdown, "speedup": it.speedup,
                            "checksum_cost": it.checksum_cost}
                           for it in self.iterations],
            "wall_seconds": self.wall_seconds,
        }


def layer_latency(transfer: tuple[tuple[float, float], ...]) -> float:
    """Median over layers of landed - posted."""
    return statistics.median(landed - posted for posted, landed in transfer)


# --- text and plot --------------------------------------------------------------------------

def format_stream(report: StreamReport) -> str:
    """Header, the end-to-end headline, the compute, the bulk vs streamed table, what the
    checksums cost and the save_layer overhead."""
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
        f"(by end-to-end speedup) after a warm-up, every byte verified on the receiving side; "
        + ("per-block checksums on both hand-offs, verified as layers land" if config.checksums
           else "no checksums (--no-checksums)"))
    verdict = "streaming lost" if m.speedup < 1.0 else "streaming paid"
    headline = (f"end to end (prefill + hand-off): streamed {m.stream_done_seconds * 1e3:.1f} "
                f"ms, bulk {m.bulk_done_seconds * 1e3:.1f} ms: {m.speedup:.2f}x ({verdict})")
    ratio = report.compute_ms_per_layer / report.transfer_ms_per_layer
    what = (f"a timed wait per layer (an accelerator's kernels; this host's cores stay free), "
            f"{report.compute_ms_per_layer:.2f} ms" if config.compute == "accelerator" else
            f"{report.matmuls_per_layer} float32 {MATMUL_N}x{MATMUL_N} matmuls per layer on one "
            f"core, {report.compute_ms_per_layer:.2f} ms")
    compute = (f"simulated prefill: {what} ({chosen})\n"
               f"transfer per layer: {report.transfer_ms_per_layer:.2f} ms in bulk; compute / "
               f"transfer = {ratio:.2f}; streamed, a layer landed "
               f"{m.layer_latency_seconds * 1e3:.2f} ms (median) after its post")
    head = ["", "bulk", "streamed"]
    rows = [
        ["prefill compute ms", ms(m.bulk_compute_seconds * 1e3),
         ms(m.stream_compute_seconds * 1e3)],
        ["transfer after the compute ms (exposed)", ms(m.bulk_transfer_seconds * 1e3),
         ms(m.stream_exposed_seconds * 1e3)],
        ["hand-off done after ms", ms(m.bulk_done_seconds * 1e3),
         ms(m.stream_done_seconds * 1e3)],
    ]
    saves = m.save_layer_seconds
    mean_us = sum(saves) / len(saves) * 1e6
    lines = [
        f"hidden fraction: {m.hidden_fraction * 100:.1f}% of the bulk transfer (1 - exposed / "
        f"bulk: the overlap, not whether it paid; the compute ran {m.compute_slowdown:.2f}x "
        "as long as in bulk)",
    ]
    cost = report.checksum_cost
    if cost is not None:
        with_ = statistics.median(it.stream_done_seconds for it in report.iterations)
        without = statistics.median(it.plain_done_seconds or 0.0 for it in report.iterations)
        pairs = sorted(it.checksum_cost or 0.0 for it in report.iterations)
        lines.append(
            f"checksums: the streamed hand-off ended {with_ * 1e3:.1f} ms after the prefill "
            f"began with them, {without * 1e3:.1f} ms without (medians of {config.iters}): "
            f"{cost * 100:+.1f}% (back-to-back pairs: {pairs[0] * 100:+.1f}% to "
            f"{pairs[-1] * 100:+.1f}%)")
    lines += [
        f"save_layer() call: mean {mean_us:.1f} us, max {max(saves) * 1e6:.1f} us "
        f"({mean_us / (report.compute_ms_per_layer * 1e3) * 100:.2f}% of a layer's compute)",
        f"receiver: last layer in {m.receiver_exposed_seconds * 1e3:.2f} ms after the last "
        "compute (same host, same clock)",
    ]
    return "\n".join([header, "", headline, "", compute, "", *aligned(head, rows, left={0}), "",
                      *lines, "", f"measured in {report.wall_seconds:.1f} s"])


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
                 f"{report.num_layers} layers: {m.speedup:.2f}x end to end, hidden "
                 f"{m.hidden_fraction * 100:.1f}% "
                 f"(transports {report.config.transports or 'by UCX'}, error mode "
                 f"{report.config.error_mode})")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)
