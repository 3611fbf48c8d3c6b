"""The serving benchmark's results (``serve``), and their text and plots (``to_dict`` is
``--json``).

TTFT is sent -> first token chunk; ITLs are the gaps between token chunks. Goodput counts
requests that finished with every token, TTFT <= ``ttft_slo`` and mean ITL (time per output
token after the first) <= ``itl_slo``: the mean, as DistServe and vLLM's benchmark define it,
because one stall of this shared CPU would otherwise disqualify a request; the stalls
themselves show in ITL p99 and max.

The KV hand-off share (disagg) is the server's ``kvmove_kv_handoff_seconds`` mean over the
client's mean TTFT: per request, from the prefill's last layer computed to the decode worker
seeing the request's KV (and first token) in: the bytes left after the last layer, the first
token's sampling, the final message, the decode's polling. Its timeline
(``kvmove_kv_handoff_stage_seconds``, mean ms after the last layer) shows where that time goes.
``kvmove_kv_exposed_seconds`` (the last layer posted to landed, as the prefill saw it) is the
part of the byte transfer streaming leaves on the critical path, and
``kvmove_kv_transfer_seconds`` (first layer posted to last landed) the whole transfer, mostly
hidden behind the prefill's compute. A server without the hand-off metric (an older one, at
``--url``) gets the share from the exposed transfer instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvmove.bench.report import aligned, ms, pyplot, save_figure

if TYPE_CHECKING:
    from kvmove.bench.serve_config import ServeBenchConfig
    from kvmove.bench.serve_trace import TraceRequest

__all__ = ["ModeResult", "QueueSample", "RequestResult", "ServeReport", "format_serve",
           "percentile", "plot_serve"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks
    (numpy's default); NaN when ``values`` is empty."""
    if not values:
        return math.nan
    ranked = sorted(values)
    position = (len(ranked) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw of one request: ``token_times`` in seconds after ``sent`` (itself
    seconds after the replay started), ``end`` when its response closed or failed."""

    index: int
    kind: str
    max_tokens: int
    sent: float
    token_times: tuple[float, ...]
    end: float
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def completed(self) -> bool:
        return self.error is None and self.tokens == self.max_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean ITL: (last token - first) / (tokens - 1); None below two tokens."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def meets(self, ttft_slo: float, itl_slo: float) -> bool:
        tpot = self.tpot
        return (self.completed and self.ttft is not None and self.ttft <= ttft_slo
                and (tpot is None or tpot <= itl_slo))


@dataclass(frozen=True, slots=True)
class QueueSample:
    """``/metrics`` at ``time`` seconds after the replay started: per pool, requests queued
    and running, and the workers taking requests."""

    time: float
    queued: dict[str, float]
    running: dict[str, float]
    workers: dict[str, float] = field(default_factory=dict)  # taking requests (the planner's)


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's replay of the trace; ``kv_*`` are deltas of the server's counters over it."""

    mode: str
    instances: dict[str, int]
    requests: tuple[RequestResult, ...]
    samples: tuple[QueueSample, ...]
    kv_bytes: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfers: int = 0
    kv_exposed_seconds: float = 0.0
    kv_handoff_seconds: float = 0.0
    kv_handoffs: int = 0
    # hand-off stage -> mean seconds after the prefill's last layer (HANDOFF_STAGES)
    kv_timeline: dict[str, float] = field(default_factory=dict)
    startup_seconds: float | None = None
    exit_code: int | None = None
    routing: str | None = None  # kvmove-serve --routing, when a run compares several
    matched_tokens: float = 0.0  # the routers' kvmove_routing_matched_tokens over the replay
    routed: int = 0              # and its count: requests placed
    planner: bool = False        # kvmove-serve --planner
    # the planner's decisions over the replay: "pool action reason" -> count
    planner_decisions: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        words = [self.mode, *([self.routing] if self.routing else []),
                 *(["planner"] if self.planner else [])]
        return " ".join(words)

    @property
    def wall_seconds(self) -> float:
        """First request sent to last response closed."""
        if not self.requests:
            return 0.0
        return (max(r.sent + r.end for r in self.requests) -
                min(r.sent for r in self.requests))

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.requests if r.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [gap for r in self.requests for gap in r.itls]

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def itl(self, q: float) -> float:
        return percentile(self.itls, q)

    @property
    def itl_spread(self) -> float:
        """ITL p99 / p50: how far the tail stands off the typical gap."""
        return self.itl(99) / self.itl(50)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        wall = self.wall_seconds
        return self.output_tokens / wall if wall > 0 else math.nan

    @property
    def failures(self) -> int:
        return sum(not r.completed for r in self.requests)

    def good(self, ttft_slo: float, itl_slo: float) -> int:
        return sum(r.meets(ttft_slo, itl_slo) for r in self.requests)

    def goodput(self, ttft_slo: float, itl_slo: float) -> float:
        """Requests within both SLOs per second of wall time."""
        wall = self.wall_seconds
        return self.good(ttft_slo, itl_slo) / wall if wall > 0 else math.nan

    @property
    def kv_handoff(self) -> float | None:
        """Mean hand-off seconds (the prefill's last layer to the decode seeing the KV in);
        the mean exposed transfer from a server that does not measure it; None without
        hand-offs."""
        if self.kv_handoffs:
            return self.kv_handoff_seconds / self.kv_handoffs
        if self.kv_transfers:
            return self.kv_exposed_seconds / self.kv_transfers
        return None

    @property
    def kv_share(self) -> float | None:
        """Mean hand-off seconds (``kv_handoff``) over mean TTFT; None without hand-offs."""
        handoff = self.kv_handoff
        if handoff is None or not self.ttfts:
            return None
        return handoff / (sum(self.ttfts) / len(self.ttfts))

    def to_dict(self, ttft_slo: float, itl_slo: float) -> dict[str, Any]:
        qs = (50, 90, 99)
        return {
            "mode": self.mode, "routing": self.routing, "instances": self.instances,
            "matched_tokens": self.matched_tokens, "routed": self.routed,
            "planner": self.planner, "planner_decisions": self.planner_decisions,
            "requests": len(self.requests), "failures": self.failures,
            "wall_seconds": self.wall_seconds, "output_tokens": self.output_tokens,
            "tokens_per_s": self.tokens_per_s,
            **{f"ttft_p{q}_ms": self.ttft(q) * 1e3 for q in qs},
            **{f"itl_p{q}_ms": self.itl(q) * 1e3 for q in qs},
            "itl_max_ms": max(self.itls, default=math.nan) * 1e3,
            "itl_p99_over_p50": self.itl_spread,
            "good_requests": self.good(ttft_slo, itl_slo),
            "goodput_per_s": self.goodput(ttft_slo, itl_slo),
            "kv_bytes": self.kv_bytes, "kv_transfers": self.kv_transfers,
            "kv_transfer_seconds": self.kv_transfer_seconds,
            "kv_exposed_seconds": self.kv_exposed_seconds,
            "kv_handoffs": self.kv_handoffs, "kv_handoff_seconds": self.kv_handoff_seconds,
            "kv_timeline_ms": {stage: seconds * 1e3 for stage, seconds in
                               self.kv_timeline.items()},
            "kv_share_of_ttft": self.kv_share,
            "startup_seconds": self.startup_seconds, "exit_code": self.exit_code,
            "per_request": [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot,
                             "completed": r.completed} for r in self.requests],
            "queue_samples": [asdict(s) for s in self.samples],
        }


@dataclass(frozen=True, slots=True)
class ServeReport:
    """Everything one ``run`` measured; ``to_dict`` is the ``--json`` form."""

    config: ServeBenchConfig
    trace: tuple[TraceRequest, ...] = field(repr=False)
    modes: tuple[ModeResult, ...]
    wall_seconds: float

    @property
    def baseline(self) -> ModeResult:
        return self.modes[0]

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": asdict(c),
            "trace": [{"index": t.index, "arrival": t.arrival, "kind": t.kind,
                       "prompt_bytes": len(t.prompt), "max_tokens": t.max_tokens,
                       "prefix": t.prefix, "repeat": t.repeat}
                      for t in self.trace],
            "modes": [m.to_dict(c.ttft_slo, c.itl_slo) for m in self.modes],
            "wall_seconds": self.wall_seconds,
        }


# --- text and plots -------------------------------------------------------------------------

_QS = (50, 90, 99)


def format_serve(report: ServeReport) -> str:
    """Header, the latency table, the throughput table, ratios against the first mode, and the
    failures (if any)."""
    return "\n".join([_header(report), "", *_latency_table(report), "",
                      *_throughput_table(report), "", *_timeline_lines(report),
                      *_prefix_lines(report), *_planner_lines(report), *_ratio_lines(report),
                      *_failure_lines(report), "",
                      f"measured in {report.wall_seconds:.1f} s"])


def _header(report: ServeReport) -> str:
    c = report.config
    num_long = sum(t.kind == "long" for t in report.trace)
    span = report.trace[-1].arrival if report.trace else 0.0
    server = f"the server at {c.url}" if c.url else "a fresh kvmove-serve per mode"
    return (f"model {c.model}, {len(report.trace)} requests (seed {c.seed}), Poisson arrivals "
            f"at {c.rate:g}/s over {span:.1f} s: {num_long} long ({c.long_prompt_bytes:,} B "
            f"prompt -> {c.long_output_tokens} tokens), {len(report.trace) - num_long} short "
            f"({c.short_prompt_bytes:,} B -> {c.short_output_tokens} tokens); chunk "
            f"{c.chunk_size} tokens; {server}, streamed with ignore_eos; SLOs: TTFT <= "
            f"{c.ttft_slo * 1e3:g} ms, mean ITL <= {c.itl_slo * 1e3:g} ms")


def _instances(result: ModeResult) -> str:
    return " + ".join(f"{n} {name}" for name, n in result.instances.items())


def _latency_table(report: ServeReport) -> list[str]:
    head = ["mode", "instances", *(f"TTFT p{q} ms" for q in _QS),
            *(f"ITL p{q} ms" for q in _QS), "ITL max ms", "ITL p99/p50"]
    rows = [[m.label, _instances(m), *(_ms_or_na(m.ttft(q)) for q in _QS),
             *(_ms_or_na(m.itl(q)) for q in _QS),
             _ms_or_na(max(m.itls, default=math.nan)), _ratio(m.itl_spread)]
            for m in report.modes]
    return aligned(head, rows, left={0, 1})


def _throughput_table(report: ServeReport) -> list[str]:
    c = report.config
    head = ["mode", "ok", "failed", "wall s", "output tokens", "tokens/s", "within SLOs",
            "goodput req/s", "KV exposed % of TTFT (transfer ms, MB)"]
    rows = [[m.label, str(len(m.requests) - m.failures), str(m.failures),
             f"{m.wall_seconds:.1f}", f"{m.output_tokens:,}", f"{m.tokens_per_s:,.1f}",
             f"{m.good(c.ttft_slo, c.itl_slo)}/{len(m.requests)}",
             f"{m.goodput(c.ttft_slo, c.itl_slo):.3f}", _kv_cell(m)]
            for m in report.modes]
    return aligned(head, rows, left={0})


def _kv_cell(result: ModeResult) -> str:
    """The hand-off's share of TTFT, then (exposed of whole transfer ms, MB); a measured
    hand-off's mean ms first, when the server measures it."""
    share, mean_handoff = result.kv_share, result.kv_handoff
    if share is None:
        return "-"
    handoff = (f"{ms(mean_handoff * 1e3)} ms hand-off; "
               if result.kv_handoffs and mean_handoff is not None else "")
    if not result.kv_transfers:
        return f"{share * 100:.2f}% ({handoff.removesuffix('; ')})"
    mean_ms = result.kv_transfer_seconds / result.kv_transfers * 1e3
    exposed_ms = result.kv_exposed_seconds / result.kv_transfers * 1e3
    return (f"{share * 100:.2f}% ({handoff}{ms(exposed_ms)} of {ms(mean_ms)} ms, "
            f"{result.kv_bytes / 1e6:,.1f} MB)")


_STAGE_NAMES = {"sent": "bytes all landed", "sampled": "first token sampled",
                "landed": "decode got the last layer", "learned": "decode saw the KV in",
                "first_step": "decode's first step"}


def _timeline_lines(report: ServeReport) -> list[str]:
    """Per mode with hand-offs: each stage's mean ms after the prefill's last layer."""
    lines = []
    for m in report.modes:
        if not m.kv_timeline:
            continue
        per = (f", {m.kv_bytes / m.kv_transfers / 1e6:,.2f} MB each" if m.kv_transfers
               else "")
        stages = ", ".join(f"{_STAGE_NAMES.get(stage, stage)} +{ms(seconds * 1e3)}"
                           for stage, seconds in sorted(m.kv_timeline.items(),
                                                        key=lambda item: item[1]))
        lines.append(f"{m.mode} KV hand-off timeline ({m.kv_handoffs} hand-offs{per}; mean ms "
                     f"after the prefill's last layer was computed): {stages}")
    return [*lines, ""] if lines else []


def _ratio_lines(report: ServeReport) -> list[str]:
    if len(report.modes) < 2:
        return []
    c, base = report.config, report.baseline
    lines = [f"against {base.label} (same trace, same run):"]
    for m in report.modes[1:]:
        repeats = ""
        if report.config.shared_prefixes:
            mine, theirs = _repeat_ttfts(report, m), _repeat_ttfts(report, base)
            repeats = (f"TTFT of repeats p50 {_over(percentile(mine, 50), percentile(theirs, 50))}"
                       f", mean {_over(_mean(mine), _mean(theirs))}, ")
        lines.append(
            f"  {m.label}: {repeats}TTFT p99 {_over(m.ttft(99), base.ttft(99))}, ITL p99 "
            f"{_over(m.itl(99), base.itl(99))}, tokens/s "
            f"{_over(m.tokens_per_s, base.tokens_per_s)}, goodput "
            f"{_over(m.goodput(c.ttft_slo, c.itl_slo), base.goodput(c.ttft_slo, c.itl_slo))}")
    return lines


def _failure_lines(report: ServeReport) -> list[str]:
    lines = []
    for m in report.modes:
        for r in m.requests:
            if not r.completed:
                why = r.error or f"{r.tokens} of {r.max_tokens} tokens"
                lines.append(f"  {m.label} request {r.index} ({r.kind}): {why}")
    return ["", "failed requests:", *lines] if lines else []


def _repeat_ttfts(report: ServeReport, result: ModeResult, repeat: bool = True) -> list[float]:
    """TTFTs of the requests whose shared prefix an earlier one began with (``repeat``), or
    of the first of each prefix."""
    repeats = {t.index for t in report.trace if t.prefix is not None and t.repeat == repeat}
    return [r.ttft for r in result.requests if r.index in repeats and r.ttft is not None]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _prefix_lines(report: ServeReport) -> list[str]:
    """With shared prefixes: TTFT of their repeats and firsts, and the prefix the router's
    choices landed on (``kvmove_routing_matched_tokens``)."""
    c = report.config
    if not c.shared_prefixes:
        return []
    head = ["mode", "repeats", "repeat TTFT p50 ms", "repeat TTFT mean ms", "firsts",
            "first TTFT p50 ms", "matched tokens / request"]
    rows = []
    for m in report.modes:
        repeats, firsts = _repeat_ttfts(report, m), _repeat_ttfts(report, m, repeat=False)
        rows.append([m.label, str(len(repeats)), _ms_or_na(percentile(repeats, 50)),
                     _ms_or_na(_mean(repeats)), str(len(firsts)),
                     _ms_or_na(percentile(firsts, 50)),
                     f"{m.matched_tokens / m.routed:,.0f}" if m.routed else "n/a"])
    return [f"{c.shared_prefixes} shared prefixes of {c.prefix_bytes:,} B:",
            *aligned(head, rows, left={0}), ""]


def _planner_lines(report: ServeReport) -> list[str]:
    """Per run with the planner: its decisions, and each pool's workers at the start, at most
    and at the end of the replay (from the ``/metrics`` samples)."""
    lines = []
    for m in report.modes:
        if not m.planner:
            continue
        decisions = ", ".join(f"{key} x{n}" for key, n in sorted(m.planner_decisions.items()))
        lines.append(f"{m.label}: planner decisions: {decisions or 'none'}")
        sampled = [s.workers for s in m.samples if s.workers]
        if sampled:
            pools = sorted({pool for w in sampled for pool in w})
            lines.append("  workers per pool (first / most / last sample): " + "; ".join(
                f"{pool} {sampled[0].get(pool, 0):.0f} / "
                f"{max(w.get(pool, 0) for w in sampled):.0f} / {sampled[-1].get(pool, 0):.0f}"
                for pool in pools))
    return [*lines, ""] if lines else []


def _over(value: float, base: float) -> str:
    return _ratio(value / base) if base and not math.isnan(base) else "n/a"


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.2f}x"


def _ms_or_na(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else ms(seconds * 1e3)


def plot_serve(report: ServeReport, prefix: str) -> tuple[str, str]:
    """Writes ``PREFIX-itl.png`` (ITL CDF per mode) and ``PREFIX-queues.png`` (per-pool
    queue length over time, one panel per mode, with the running requests dotted); returns
    their paths."""
    paths = (f"{prefix}-itl.png", f"{prefix}-queues.png")
    for path, draw in zip(paths, (_plot_itl, _plot_queues)):
        save_figure(draw(pyplot(), report), path)
    return paths


def _plot_itl(plt: Any, report: ServeReport) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in report.modes:
        gaps = sorted(g * 1e3 for g in m.itls)
        if gaps:
            ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post",
                    label=f"{m.mode} (p99 {ms(m.itl(99) * 1e3)} ms)")
    ax.axvline(report.config.itl_slo * 1e3, color="gray", linestyle=":",
               label="ITL SLO (applies to the mean)")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency, ms (client side)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title(f"ITL CDF: {report.config.model}, {len(report.trace)} requests at "
                 f"{report.config.rate:g}/s")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def _plot_queues(plt: Any, report: ServeReport) -> Any:
    n = len(report.modes)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 * n + 0.6), sharex=True,
                             squeeze=False)
    for ax, m in zip(axes[:, 0], report.modes):
        pools = sorted({pool for s in m.samples for pool in s.queued})
        times = [s.time for s in m.samples]
        for index, pool in enumerate(pools):
            color = f"C{index}"
            ax.plot(times, [s.queued.get(pool, 0) for s in m.samples], color=color,
                    drawstyle="steps-post", label=f"{pool}: queued")
            ax.plot(times, [s.running.get(pool, 0) for s in m.samples], color=color,
                    drawstyle="steps-post", linestyle=":", alpha=0.7, label=f"{pool}: running")
        ax.set_ylabel("requests")
        ax.set_title(f"{m.mode} ({_instances(m)})", fontsize=9)
        if pools:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the first request")
    return fig
