"""Text, JSON-ready and plotted forms of ``kvmove-bench`` results (the CLI prints them)."""

from __future__ import annotations

from kvmove.bench.transfer_report import BenchReport
from kvmove.bench.stream import MATMUL_N, StreamReport
from kvmove.bench.plan import Plan

__all__ = ["format_plan", "format_stream", "format_transfer", "plot_stream", "plot_transfer"]

_COLORS = {"write": "tab:blue", "ucp_put_bw": "tab:blue", "read": "tab:orange",
           "ucp_get": "tab:orange"}


def format_transfer(report: BenchReport) -> str:
    """Header, one row per configuration, the baselines, the round trip and the links."""
    config = report.config
    layout = config.layout(config.block_sizes[0])
    kv_bytes = layout.bytes_for(config.num_tokens)
    transports = config.transports or "UCX's choice"
    header = (
        f"{config.model} ({layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim "
        f"{layout.head_dim}, {layout.dtype}), {config.num_tokens:,} tokens: KV {kv_bytes:,} B "
        f"({_human_bytes(kv_bytes)}); caches of {config.spare_factor}x the blocks moved; "
        f"transports {transports}, error mode {config.error_mode}; "
        f"best of {config.iters} after a warm-up, every byte verified on the receiving side"
    )
    return "\n".join([header, "", *_transfer_table(report), "", *_baseline_lines(report), "",
                      *_round_trip_lines(report), "", *_link_lines(report),
                      "", f"measured in {report.wall_seconds:.1f} s"])


def _transfer_table(report: BenchReport) -> list[str]:
    head = ["op", "placement", "block", "bytes", "blocks", "ops posted", "post ms", "total ms",
            "post %", "GB/s", "% of memcpy", "% of perftest", "verified"]
    rows = [[row.op, row.placement, str(row.block_size), f"{row.nbytes:,}",
             f"{row.num_blocks:,}", f"{row.num_ops:,}", _ms(row.post_seconds * 1e3),
             _ms(row.total_seconds * 1e3), f"{row.post_share_pct:.2f}%",
             f"{row.gbytes_per_s:.2f}", f"{report.memcpy_pct(row):.1f}%",
             _pct(report.perftest_pct(row)), "yes" if row.verified else "NO"]
            for row in report.rows]
    return _aligned(head, rows, left={0, 1, len(head) - 1})


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"


def _baseline_lines(report: BenchReport) -> list[str]:
    lines = ["baselines measured in this run (perftest: same transports, message size = kvmove's "
             "mean bytes per posted op):"]
    lines += [f"  memcpy (numpy copyto) of {nbytes:,} B: {gbps:.2f} GB/s"
              for nbytes, gbps in report.memcpy.items()]
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
    rows = [[link["name"], f"{link['gbytes_per_s']:.3g}", _ms(link["transfer_ms"]),
             "measured" if link["measured"] else "nominal"] for link in links]
    return [f"the same {nbytes:,} B over the article's links, and as measured here:",
            *_aligned(head, rows, left={0, 3})]


def plot_transfer(report: BenchReport, path: str) -> None:
    """Bandwidth against bytes per operation: kvmove's rows over ucx_perftest's curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for test in ("ucp_put_bw", "ucp_get"):
        points = sorted((p.message_nbytes, p.gbytes_per_s) for p in report.perftest_bw
                        if p.test == test and p.available)
        if points:
            ax.plot(*zip(*points), "--", color=_COLORS[test], alpha=0.5,
                    label=f"ucx_perftest {test}")
    for row in report.rows:
        ax.scatter(row.op_nbytes, row.gbytes_per_s, s=50, color=_COLORS[row.op],
                   marker="o" if row.placement == "allocator" else "s",
                   label=f"kvmove {row.op} ({row.placement})")
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- stream ---------------------------------------------------------------------------------


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
        f"(by hidden fraction) after a warm-up, every byte verified on the receiving side")
    ratio = report.compute_ms_per_layer / report.transfer_ms_per_layer
    compute = (f"simulated prefill: {report.matmuls_per_layer} float32 {MATMUL_N}x{MATMUL_N} "
               f"matmuls per layer, {report.compute_ms_per_layer:.2f} ms ({chosen})\n"
               f"transfer per layer: {report.transfer_ms_per_layer:.2f} ms in bulk; compute / "
               f"transfer = {ratio:.2f} (the target applies from 1); streamed, a layer "
               f"landed {m.layer_latency_seconds * 1e3:.2f} ms (median) after its post")
    head = ["", "bulk", "streamed"]
    rows = [
        ["prefill compute ms", _ms(m.bulk_compute_seconds * 1e3),
         _ms(m.stream_compute_seconds * 1e3)],
        ["transfer after the compute ms (exposed)", _ms(m.bulk_transfer_seconds * 1e3),
         _ms(m.stream_exposed_seconds * 1e3)],
        ["hand-off done after ms", _ms((m.bulk_compute_seconds + m.bulk_transfer_seconds) * 1e3),
         _ms((m.stream_compute_seconds + m.stream_exposed_seconds) * 1e3)],
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
    return "\n".join([header, "", compute, "", *_aligned(head, rows, left={0}), "", *lines,
                      "", f"measured in {report.wall_seconds:.1f} s"])


def plot_stream(report: StreamReport, path: str) -> None:
    """Timeline of the median iteration: per layer, compute and transfer, bulk vs streamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report.median
    t0 = m.compute[0][0]
    ms = [((start - t0) * 1e3, (end - start) * 1e3) for start, end in m.compute]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.broken_barh(ms, (30, 8), facecolors="tab:blue", edgecolor="white", linewidth=0.3)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- plan -----------------------------------------------------------------------------------


def format_plan(result: Plan) -> str:
    """The plan as a header line, one table row per link, and the advice."""
    layout = result.layout
    header = (
        f"{result.model or 'custom layout'} ({layout.num_layers} layers, {layout.num_kv_heads} "
        f"KV heads, head_dim {layout.head_dim}, {layout.dtype}), {result.num_tokens:,} tokens: "
        f"KV {result.kv_bytes:,} B ({_human_bytes(result.kv_bytes)}), "
        f"{result.bytes_per_token:,} B/token, {result.num_blocks:,} blocks of "
        f"{layout.block_size}; prefill {result.prefill_ms:g} ms"
    )
    advice = [f"  - {line}" for line in result.advice]
    return "\n".join([header, "", *_table(result), "", "advice:", *advice])


def _table(result: Plan) -> list[str]:
    head = ["link", "GB/s", "transfer ms", "% of prefill", "exposed ms (streamed)", "verdict"]
    rows = [[row.link.name, f"{row.link.gbytes_per_s:g}", _ms(row.transfer_ms),
             f"{row.prefill_share_pct:.1f}%", _ms(row.exposed_ms), row.verdict.value]
            for row in result.rows]
    return _aligned(head, rows, left={0, len(head) - 1})


def _aligned(head: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """Columns padded to their widest cell: ``left`` ones read left to right (names), the
    others line up on the right (numbers)."""
    widths = [max(len(cells[i]) for cells in [head, *rows]) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()
            for cells in [head, *rows]]


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}"


def _human_bytes(nbytes: int) -> str:
    """``"524.3 MB, 500.0 MiB"``: decimal and binary units side by side."""
    return f"{_scaled(nbytes, 1000, 'kMGT', 'B')}, {_scaled(nbytes, 1024, 'KMGT', 'iB')}"


def _scaled(nbytes: int, base: int, prefixes: str, suffix: str) -> str:
    value, unit = float(nbytes), "B"
    for prefix in prefixes:
        if value < base:
            break
        value, unit = value / base, prefix + suffix
    return f"{value:.1f} {unit}"

