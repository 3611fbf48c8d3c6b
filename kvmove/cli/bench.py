"""``kvmove-bench``: plan and measure KV-cache hand-offs between prefill and decode nodes.

Subcommands:
    transfer  (default) moves one prompt's KV cache between two processes with kvmove, verifies
              every byte, and compares the bandwidth with memcpy and ``ucx_perftest`` measured
              in the same run, then with the article's links.
    plan      what moving one prompt's KV cache costs on each link, and whether to disaggregate
              (arithmetic from the model's layout; nothing is sent).

With no subcommand, or options only, ``DEFAULT_COMMAND`` runs. Bad input exits with status 2
and a message on stderr naming the value; a failed or unverified transfer exits with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from kvmove import bench_transfer
from kvmove.bench_transfer import BenchConfig, BenchReport
from kvmove.errors import ConfigError, KVMoveError
from kvmove.layout import DTYPE_BYTES, PRESETS, KVLayout
from kvmove.plan import DEFAULT_LINKS, Link, Plan, merge_links, parse_link, plan

# The subcommand that runs when none is given.
DEFAULT_COMMAND = "transfer"


def main(argv: list[str] | None = None) -> int:
    """Run ``kvmove-bench``; returns the exit status (argparse errors raise ``SystemExit(2)``)."""
    parser = _parser()
    args = parser.parse_args(_with_default_command(sys.argv[1:] if argv is None else argv))
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KVMoveError as error:  # a transfer, the peer process or UCX failed
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `kvmove-bench --json | head`: the reader left; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _with_default_command(argv: list[str]) -> list[str]:
    """Prepend ``DEFAULT_COMMAND`` unless ``argv`` starts with a subcommand or asks for help."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return [DEFAULT_COMMAND, *argv]
    return list(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmove-bench",
        description="Plan and measure KV-cache hand-offs between prefill and decode nodes.",
        epilog=f"With no subcommand, '{DEFAULT_COMMAND}' runs.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_transfer(commands)
    _add_plan(commands)
    return parser


# --- transfer -------------------------------------------------------------------------------

# --sweep also runs ucx_perftest at these message sizes, so the plot has a baseline curve.
SWEEP_MESSAGE_SIZES = (4096, 65536, 1 << 20, 16 << 20)
# A WRITE row and the ucp_put_bw curve it is compared with share a color; READ and ucp_get too.
_COLORS = {"write": "tab:blue", "ucp_put_bw": "tab:blue", "read": "tab:orange",
           "ucp_get": "tab:orange"}


def _add_transfer(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "transfer", help="move one prompt's KV cache between two processes and measure it",
        description="Moves one prompt's KV cache between two local processes with kvmove "
        "(WRITE and READ), verifies every byte, and compares with memcpy and ucx_perftest "
        "measured in the same run.")
    sub.add_argument("--model", choices=list(PRESETS), default="llama-3.1-8b", metavar="NAME",
                     help=f"model preset, one of: {', '.join(PRESETS)} (default %(default)s)")
    sub.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000)")
    sub.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    sub.add_argument("--transports", default=None, metavar="UCX_TLS",
                     help="UCX transport list for kvmove and ucx_perftest, e.g. tcp, "
                     "'posix,cma' (default: UCX's choice)")
    sub.add_argument("--error-mode", choices=["peer", "none"], default="peer",
                     help="'peer' detects dead peers (UCX then drops posix/sysv shared memory); "
                     "'none' keeps shared memory (default peer, as kvmove.Agent)")
    sub.add_argument("--scatter", action="store_true",
                     help="add rows with blocks scattered at random over both caches")
    sweep_sizes = "/".join(map(str, bench_transfer.SWEEP_BLOCK_SIZES))
    sub.add_argument("--sweep", action="store_true",
                     help=f"rows for block sizes {sweep_sizes}, and ucx_perftest at more "
                     "message sizes")
    sub.add_argument("--iters", type=int, default=3,
                     help="timed iterations per row, after one warm-up; the best is shown "
                     "(default 3)")
    sub.add_argument("--timeout", type=float, default=60.0,
                     help="deadline of every wait in seconds (default 60)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PNG", default=None,
                     help="also draw bandwidth vs bytes per operation (needs matplotlib)")
    sub.set_defaults(run=_run_transfer)


def _run_transfer(args: argparse.Namespace) -> int:
    config = _transfer_config(args)
    if args.plot:
        _check_plot(args.plot)
    report = _run_with_progress(config, show=args.sweep)
    if args.plot:
        _plot(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_transfer(report))
    if not report.verified:
        bad = [f"{r.op} {r.placement} block {r.block_size}: {r.mismatched_blocks}"
               for r in report.rows if not r.verified]
        print(f"kvmove-bench transfer: error: bytes arrived wrong ((layer, block) pairs per "
              f"row, all iterations): {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _transfer_config(args: argparse.Namespace) -> BenchConfig:
    sizes = (args.block_size,)
    if args.sweep:
        sizes += tuple(s for s in bench_transfer.SWEEP_BLOCK_SIZES if s != args.block_size)
    return BenchConfig(
        model=args.model, num_tokens=args.tokens, block_sizes=sizes,
        placements=("allocator", "scatter") if args.scatter else ("allocator",),
        transports=args.transports, error_mode=args.error_mode, iters=args.iters,
        perftest_sizes=SWEEP_MESSAGE_SIZES if args.sweep else (), timeout=args.timeout)


def _check_plot(path: str) -> None:
    """Before measuring: ``path``'s folder there, and matplotlib importable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path!r}: no folder {folder!r} to write it in")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install kvmove[bench]") from None


def _run_with_progress(config: BenchConfig, show: bool) -> BenchReport:
    """``bench_transfer.run`` with a tqdm bar on stderr when ``show`` and tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        show = False
    if not show:
        return bench_transfer.run(config)
    with tqdm(total=bench_transfer.count_steps(config), file=sys.stderr, unit="step",
              desc="kvmove-bench transfer") as bar:
        return bench_transfer.run(config, _bar_progress(bar))


def _bar_progress(bar: object) -> Callable[[str], None]:
    def progress(label: str) -> None:
        bar.set_postfix_str(label)  # type: ignore[attr-defined]
        bar.update()  # type: ignore[attr-defined]
    return progress


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


def _plot(report: BenchReport, path: str) -> None:
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


# --- plan -----------------------------------------------------------------------------------

def _add_plan(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("plan", help="cost of one prompt's KV hand-off on each link")
    sub.add_argument("--model", choices=list(PRESETS), default="llama-3.1-8b", metavar="NAME",
                     help=f"model preset, one of: {', '.join(PRESETS)} (default %(default)s)")
    sub.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000)")
    sub.add_argument("--prefill-ms", type=float, default=200.0,
                     help="prefill time of that prompt in ms (default 200)")
    sub.add_argument("--link", type=_link_arg, action="append", default=[], metavar="NAME=GBps",
                     help="add a link (repeatable); a default's name replaces that default")
    sub.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float16",
                     help="KV element type (default float16)")
    sub.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    sub.add_argument("--json", action="store_true", help="print the plan as JSON only")
    sub.set_defaults(run=_run_plan)


def _link_arg(text: str) -> Link:
    # argparse would turn a ValueError into "invalid _link_arg value"; keep our message.
    try:
        return parse_link(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _run_plan(args: argparse.Namespace) -> int:
    layout = KVLayout.preset(args.model, dtype=args.dtype, block_size=args.block_size)
    links = merge_links(DEFAULT_LINKS, args.link)
    result = plan(layout, args.tokens, args.prefill_ms, links, model=args.model)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


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


if __name__ == "__main__":
    raise SystemExit(main())
