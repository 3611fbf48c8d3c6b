"""Text and plotted forms of the serving benchmark's results (``kvmove.bench.serve``; the CLI
prints them, ``--json`` is ``ServeReport.to_dict()``)."""

from __future__ import annotations

import math
from typing import Any

from kvmove.bench.serve import ModeResult, ServeReport
from kvmove.bench.report import _aligned, _ms

__all__ = ["format_serve", "plot_serve"]

_QS = (50, 90, 99)


def format_serve(report: ServeReport) -> str:
    """Header, the latency table, the throughput table, ratios against the first mode, and the
    failures (if any)."""
    return "\n".join([_header(report), "", *_latency_table(report), "",
                      *_throughput_table(report), "", *_ratio_lines(report),
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
    rows = [[m.mode, _instances(m), *(_ms_or_na(m.ttft(q)) for q in _QS),
             *(_ms_or_na(m.itl(q)) for q in _QS),
             _ms_or_na(max(m.itls, default=math.nan)), _ratio(m.itl_spread)]
            for m in report.modes]
    return _aligned(head, rows, left={0, 1})


def _throughput_table(report: ServeReport) -> list[str]:
    c = report.config
    head = ["mode", "ok", "failed", "wall s", "output tokens", "tokens/s", "within SLOs",
            "goodput req/s", "KV exposed % of TTFT (transfer ms, MB)"]
    rows = [[m.mode, str(len(m.requests) - m.failures), str(m.failures),
             f"{m.wall_seconds:.1f}", f"{m.output_tokens:,}", f"{m.tokens_per_s:,.1f}",
             f"{m.good(c.ttft_slo, c.itl_slo)}/{len(m.requests)}",
             f"{m.goodput(c.ttft_slo, c.itl_slo):.3f}", _kv_cell(m)]
            for m in report.modes]
    return _aligned(head, rows, left={0})


def _kv_cell(result: ModeResult) -> str:
    share = result.kv_share
    if share is None:
        return "-"
    mean_ms = result.kv_transfer_seconds / result.kv_transfers * 1e3
    exposed_ms = result.kv_exposed_seconds / result.kv_transfers * 1e3
    return (f"{share * 100:.2f}% ({_ms(exposed_ms)} of {_ms(mean_ms)} ms, "
            f"{result.kv_bytes / 1e6:,.1f} MB)")


def _ratio_lines(report: ServeReport) -> list[str]:
    if len(report.modes) < 2:
        return []
    c, base = report.config, report.baseline
    lines = [f"against {base.mode} (same trace, same run):"]
    for m in report.modes[1:]:
        lines.append(
            f"  {m.mode}: TTFT p99 {_over(m.ttft(99), base.ttft(99))}, ITL p99 "
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
                lines.append(f"  {m.mode} request {r.index} ({r.kind}): {why}")
    return ["", "failed requests:", *lines] if lines else []


def _over(value: float, base: float) -> str:
    return _ratio(value / base) if base and not math.isnan(base) else "n/a"


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) or math.isinf(value) else f"{value:.2f}x"


def _ms_or_na(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else _ms(seconds * 1e3)


def plot_serve(report: ServeReport, prefix: str) -> tuple[str, str]:
    """Writes ``PREFIX-itl.png`` (ITL CDF per mode) and ``PREFIX-queues.png`` (per-pool
    queue length over time, one panel per mode, with the running requests dotted); returns
    their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = (f"{prefix}-itl.png", f"{prefix}-queues.png")
    for path, draw in zip(paths, (_plot_itl, _plot_queues)):
        fig = draw(plt, report)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return paths


def _plot_itl(plt: Any, report: ServeReport) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in report.modes:
        gaps = sorted(g * 1e3 for g in m.itls)
        if gaps:
            ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post",
                    label=f"{m.mode} (p99 {_ms(m.itl(99) * 1e3)} ms)")
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
