"""The text and plot of a ``kvmove-bench transfer`` report (``transfer_report.BenchReport``)."""

from __future__ import annotations

import textwrap

from kvmove.bench.against_report import nixl_lines
from kvmove.bench.mooncake_report import mooncake_lines
from kvmove.bench.report import aligned, human_bytes, ms, pyplot, save_figure
from kvmove.bench.transfer_report import (
    REGISTRATION_TIMED,
    BenchConfig,
    BenchReport,
)

__all__ = ["format_transfer", "plot_transfer"]


_COLORS = {"write": "tab:blue", "ucp_put_bw": "tab:blue", "read": "tab:orange",
           "ucp_get": "tab:orange"}


def format_transfer(report: BenchReport) -> str:
    """Header, one row per configuration, the baselines, the round trip and the links."""
    config = report.config
    layout = config.layout(config.block_sizes[0])
    kv_bytes = layout.bytes_for(config.num_tokens)
    transports = config.transports or "UCX's choice"
    if report.transports_used:
        transports += " (" + " ".join(f"{tl}/{dev}" for tl, dev in report.transports_used) + ")"
    header = (
        f"{config.model} ({layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim "
        f"{layout.head_dim}, {layout.dtype}), {config.num_tokens:,} tokens: KV {kv_bytes:,} B "
        f"({human_bytes(kv_bytes)}); caches of {config.spare_factor}x the blocks moved; "
        f"far side {_far_side(config)}; {_memory_words(config)}"
        f"{_path_words(report.path)}transports {transports}, error mode {config.error_mode}; "
        f"best of {config.iters} after a warm-up, every byte verified on the receiving side"
    )
    ucx = [report.ucx.summary()] if report.ucx is not None else []
    return "\n".join([header, *ucx, *_wrap_lines(report), "", *_transfer_table(report), "",
                      *_nixl_lines(report), *_mooncake_lines(report),
                      *_registration_lines(report), "",
                      *_baseline_lines(report), "",
                      *_round_trip_lines(report), "", *_link_lines(report),
                      "", f"measured in {report.wall_seconds:.1f} s"])


def _memory_words(config: BenchConfig) -> str:
    return "both caches in device memory (cuda:0); " if config.memory == "cuda" else ""


def _far_side(config: BenchConfig) -> str:
    if config.connect is None:
        return "a process on this host"
    return f"the --listen side at {config.connect} (this side {config.host})"


def _path_words(path: str) -> str:
    if path == "mapped":
        return "bytes copied into the peer's mapped memory (same host), notifications over "
    if path == "ucx":
        return "bytes and notifications over "
    return ""


def _wrap_lines(report: BenchReport) -> list[str]:
    config = report.config
    if config.wrap is None:
        return []
    layout = config.layout(config.block_sizes[0])
    mla = (f", as one MLA latent of {layout.head_dim} per token (the same bytes; the native "
           "cache too)" if config.wrap == "mla" else "")
    return [f"caches: native (KVCache), then {config.wrap}: the engine's tensors as numpy "
            f"arrays wrapped with KVCache.wrap as docs/engines.md says{mla}; 'x native' is "
            "wrapped GB/s over native GB/s in this run (target >= 0.90)"]


def _transfer_table(report: BenchReport) -> list[str]:
    """One line per row; with ``--wrap``, a cache column and the ratio to native."""
    wrap = report.config.wrap is not None
    head = ["op", "placement", *["cache"] * wrap, "block", "bytes", "blocks", "ops posted",
            "post ms", "total ms", "post %", "GB/s", *["x native"] * wrap, "% of memcpy",
            "% of limit", "% of perftest", "verified"]
    rows = []
    for row in report.rows:
        ratio = report.native_ratio(row)
        rows.append([row.op, row.placement, *[row.cache] * wrap, str(row.block_size),
                     f"{row.nbytes:,}", f"{row.num_blocks:,}", f"{row.num_ops:,}",
                     ms(row.post_seconds * 1e3), ms(row.total_seconds * 1e3),
                     f"{row.post_share_pct:.2f}%", f"{row.gbytes_per_s:.2f}",
                     *[("-" if ratio is None else f"{ratio:.2f}")] * wrap,
                     f"{report.memcpy_pct(row):.1f}%", _pct(report.limit_pct(row)),
                     _pct(report.perftest_pct(row)),
                     "yes" if row.verified else "NO"])
    return aligned(head, rows, left={0, 1, 2 * wrap, len(head) - 1})


def _nixl_lines(report: BenchReport) -> list[str]:
    """With "nixl" in ``against``: the comparison and a blank line; else nothing."""
    if report.nixl is None:
        return []
    config = report.config
    transports = config.transports or "UCX's choice"
    setting = f"transports {transports}, error mode {config.error_mode}"
    return [*nixl_lines(report.nixl, report.rows, report.round_trip, setting), ""]


def _mooncake_lines(report: BenchReport) -> list[str]:
    """With "mooncake" in ``against``: the comparison and a blank line; else nothing."""
    if report.mooncake is None:
        return []
    config = report.config
    transports = config.transports or "UCX's choice"
    setting = (f"transports {transports}, same host {config.same_host}, error mode "
               f"{config.error_mode}")
    return [*mooncake_lines(report.mooncake, report.rows, report.round_trip, setting), ""]


def _registration_lines(report: BenchReport) -> list[str]:
    head = ["cache", "block", "bytes", "wrap ms", "Agent ms", "s/GB"]
    rows = [[r.cache, str(r.block_size), f"{r.nbytes:,}", ms(r.wrap_seconds * 1e3),
             ms(r.agent_seconds * 1e3), f"{r.seconds_per_gb:.3f}"]
            for r in report.registrations]
    timed = textwrap.wrap(f"timed: {REGISTRATION_TIMED}", width=98)
    return ["registration per GB of cache:", *[f"  {line}" for line in timed],
            *aligned(head, rows, left={0})]


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def _baseline_lines(report: BenchReport) -> list[str]:
    lines = ["baselines measured in this run (perftest: same transports, message size = kvmove's "
             "mean bytes per posted op):"]
    lines += [f"  memcpy (numpy copyto, one thread) of {nbytes:,} B: {gbps:.2f} GB/s"
              for nbytes, gbps in report.memcpy.items()]
    lines += [f"  copy limit (kvmove's copy kernel, {report.copy_threads} threads, one "
              f"process: what a same-host transfer reaches at best) of {nbytes:,} B: "
              f"{gbps:.2f} GB/s" for nbytes, gbps in report.copy_limit.items()]
    for result in report.perftest_bw:
        value = (f"{result.gbytes_per_s:.2f} GB/s" if result.available
                 else f"unavailable: {result.reason}")
        lines.append(f"  ucx_perftest {result.test} {result.message_nbytes:,} B: {value}")
    return lines


def _round_trip_lines(report: BenchReport) -> list[str]:
    trip = report.round_trip
    lines = [f"round trip (one block of layer 0, {trip.nbytes:,} B, written with a notification "
             f"and answered the same way): {trip.one_way_us:.1f} us one way, median of "
             f"{trip.iterations}"]
    for result in report.perftest_lat:
        if not result.available:
            lines.append(f"  ucx_perftest ucp_put_lat {result.message_nbytes:,} B: "
                         f"unavailable: {result.reason}")
            continue
        ratio = trip.one_way_us / result.latency_us if result.latency_us else float("inf")
        lines.append(f"  ucx_perftest ucp_put_lat {result.message_nbytes:,} B: "
                     f"{result.latency_us:.1f} us (kvmove {ratio:.1f}x)")
    return lines


def _link_lines(report: BenchReport) -> list[str]:
    links = report.links()
    nbytes = next(r.nbytes for r in report.rows)
    head = ["link", "GB/s", "transfer ms", ""]
    rows = [[link["name"], f"{link['gbytes_per_s']:.3g}", ms(link["transfer_ms"]),
             "measured" if link["measured"] else "nominal"] for link in links]
    return [f"the same {nbytes:,} B over the article's links, and as measured here:",
            *aligned(head, rows, left={0, 3})]


def plot_transfer(report: BenchReport, path: str) -> None:
    """Bandwidth against bytes per operation: kvmove's rows over ucx_perftest's curves."""
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for test in ("ucp_put_bw", "ucp_get"):
        points = sorted((p.message_nbytes, p.gbytes_per_s) for p in report.perftest_bw
                        if p.test == test and p.available)
        if points:
            ax.plot(*zip(*points), "--", color=_COLORS[test], alpha=0.5,
                    label=f"ucx_perftest {test}")
    for row in report.rows:
        ax.scatter(row.op_nbytes, row.gbytes_per_s, s=50, color=_COLORS[row.op],
                   marker="o" if row.placement == "allocator" else "s",
                   label=f"kvmove {row.op} ({row.placement}, {row.cache})")
        ax.annotate(f"bs {row.block_size}", (row.op_nbytes, row.gbytes_per_s), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.axhline(max(report.memcpy.values()), linestyle=":", color="gray", label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per operation (kvmove: mean per posted op)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{report.config.model}, {report.config.num_tokens:,} tokens, transports "
                 f"{report.config.transports or 'by UCX'}, error mode {report.config.error_mode}")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one entry per label, not per row
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    save_figure(fig, path)

