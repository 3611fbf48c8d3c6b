"""``kvmove-bench``: plan and measure KV-cache hand-offs between prefill and decode nodes.

Subcommands:
    transfer  (default) moves one prompt's KV cache between two processes with kvmove, verifies
              every byte, and compares the bandwidth with memcpy and ``ucx_perftest`` measured
              in the same run, then with the article's links.
    stream    how much of that hand-off layer-wise streaming hides behind a (simulated) prefill:
              bulk vs streamed, between two processes, every byte verified.
    engine    the reference engine's prefill and decode throughput on this machine, and the
              asymmetry: decode gains from batching, prefill does not (needs torch).
    store     the KVStore's host and disk tiers against memcpy / dd / a plain file, and the
              time to first token of a repeated prompt: recompute vs host hit vs disk hit.
    serve     one seeded request trace against kvmove-serve in each mode (colocated, chunked,
              disagg): TTFT, ITL, throughput, goodput (needs kvmove[serve] and openai).
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

from kvmove.bench import stream as bench_stream, transfer as bench_transfer
from kvmove.bench.stream import StreamConfig
from kvmove.bench.transfer import BenchConfig, BenchReport
from kvmove.errors import ConfigError, KVMoveError
from kvmove.layout import DTYPE_BYTES, PRESETS, KVLayout
from kvmove.agent import ERROR_MODES
from kvmove.bench.report import (format_plan, format_stream, format_transfer, plot_stream,
                               plot_transfer)
from kvmove.bench.plan import DEFAULT_LINKS, Link, merge_links, parse_link, plan

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
    _add_stream(commands)
    _add_engine(commands)
    _add_store(commands)
    _add_serve(commands)
    _add_plan(commands)
    return parser


# --- transfer -------------------------------------------------------------------------------

# --sweep also runs ucx_perftest at these message sizes, so the plot has a baseline curve.
SWEEP_MESSAGE_SIZES = (4096, 65536, 1 << 20, 16 << 20)
# A WRITE row and the ucp_put_bw curve it is compared with share a color; READ and ucp_get too.


def _add_prompt_args(sub: argparse.ArgumentParser) -> None:
    """The model and prompt both subcommands describe: --model, --tokens, --block-size."""
    sub.add_argument("--model", choices=list(PRESETS), default="llama-3.1-8b", metavar="NAME",
                     help=f"model preset, one of: {', '.join(PRESETS)} (default %(default)s)")
    sub.add_argument("--tokens", type=int, default=4000, help="prompt length (default 4000)")
    sub.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")


def _add_transfer(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "transfer", help="move one prompt's KV cache between two processes and measure it",
        description="Moves one prompt's KV cache between two local processes with kvmove "
        "(WRITE and READ), verifies every byte, and compares with memcpy and ucx_perftest "
        "measured in the same run.")
    _add_prompt_args(sub)
    _add_agent_args(sub, "kvmove and ucx_perftest")
    sub.add_argument("--scatter", action="store_true",
                     help="add rows with blocks scattered at random over both caches")
    sweep_sizes = "/".join(map(str, bench_transfer.SWEEP_BLOCK_SIZES))
    sub.add_argument("--sweep", action="store_true",
                     help=f"rows for block sizes {sweep_sizes}, and ucx_perftest at more "
                     "message sizes")
    _add_output_args(sub, "timed iterations per row, after one warm-up; the best is shown",
                     "also draw bandwidth vs bytes per operation (needs matplotlib)")
    sub.set_defaults(run=_run_transfer)


def _add_agent_args(sub: argparse.ArgumentParser, who: str) -> None:
    """--transports and --error-mode, as kvmove.Agent takes them."""
    sub.add_argument("--transports", default=None, metavar="UCX_TLS",
                     help=f"UCX transport list for {who}, e.g. tcp, 'posix,cma' (default: "
                     "UCX's choice)")
    sub.add_argument("--error-mode", choices=list(ERROR_MODES), default="peer",
                     help="'peer' detects dead peers (UCX then drops posix/sysv shared memory); "
                     "'none' keeps shared memory (default peer, as kvmove.Agent)")


def _add_output_args(sub: argparse.ArgumentParser, iters_help: str, plot_help: str) -> None:
    """--iters, --timeout, --json and --plot."""
    sub.add_argument("--iters", type=int, default=3, help=f"{iters_help} (default 3)")
    sub.add_argument("--timeout", type=float, default=60.0,
                     help="deadline of every wait in seconds (default 60)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PNG", default=None, help=plot_help)


def _run_transfer(args: argparse.Namespace) -> int:
    config = _transfer_config(args)
    if args.plot:
        _check_plot(args.plot)
    report = _run_with_progress(config, show=args.sweep)
    if args.plot:
        plot_transfer(report, args.plot)
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


# --- stream ---------------------------------------------------------------------------------


def _add_stream(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "stream", help="how much of the hand-off layer-wise streaming hides behind prefill",
        description="Runs a simulated prefill here (per layer, float32 matmuls timed to a "
        "chosen multiple of the layer's measured transfer time) and hands the KV to a peer "
        "process twice: in bulk after the last layer, and streamed with save_layer() after "
        "each. Reports the transfer left exposed after the compute and the hidden fraction "
        "(1 - exposed / bulk transfer); every byte verified on the receiving side.")
    _add_prompt_args(sub)
    _add_agent_args(sub, "both agents")
    sub.add_argument("--compute-ratio", type=float, default=1.0,
                     help="per-layer compute as a multiple of the per-layer transfer time "
                     "measured first (default 1.0: equal)")
    sub.add_argument("--compute-ms", type=float, default=None,
                     help="per-layer compute in ms, fixed (overrides --compute-ratio)")
    _add_output_args(sub, "timed iterations, after one warm-up; the median is shown",
                     "also draw the timeline of compute and transfer per layer (needs "
                     "matplotlib)")
    sub.set_defaults(run=_run_stream)


def _run_stream(args: argparse.Namespace) -> int:
    config = StreamConfig(
        model=args.model, num_tokens=args.tokens, block_size=args.block_size,
        transports=args.transports, error_mode=args.error_mode,
        compute_ratio=args.compute_ratio, compute_ms=args.compute_ms, iters=args.iters,
        timeout=args.timeout)
    if args.plot:
        _check_plot(args.plot)
    report = bench_stream.run(config)
    if args.plot:
        plot_stream(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_stream(report))
    if not report.verified:
        print("kvmove-bench stream: error: bytes arrived wrong on the receiving side",
              file=sys.stderr)
        return 1
    return 0


# --- engine ---------------------------------------------------------------------------------


def _add_engine(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "engine", help="the reference engine's prefill and decode throughput here",
        description="Times LlamaForCausalLM.forward (random weights) on this machine: a long "
        "prefill, prefills of several prompts at once, and decode steps at several batch "
        "sizes, each against batch 1 in the same run. Needs torch (kvmove[engine]).")
    sub.add_argument("--model", default="small", metavar="PRESET",
                     help="engine model preset: tiny or small (default small)")
    sub.add_argument("--prompt-tokens", type=int, default=2000,
                     help="the long prefill's prompt length (default 2000)")
    sub.add_argument("--decode-batch-sizes", type=int, nargs="+", default=[1, 4, 16],
                     metavar="N", help="decode batch sizes (default 1 4 16)")
    sub.add_argument("--context-tokens", type=int, default=512,
                     help="tokens already in the cache of each decoding sequence (default 512)")
    sub.add_argument("--iters", type=int, default=5,
                     help="timed iterations, after one warm-up; the median is shown (default 5)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.set_defaults(run=_run_engine)


def _run_engine(args: argparse.Namespace) -> int:
    try:  # torch is the engine's, not the core's
        from kvmove.bench import engine as bench_engine
        from kvmove.bench.engine_report import format_engine
    except ImportError as error:
        raise ConfigError(f"kvmove-bench engine needs the engine's dependencies: pip install "
                          f"kvmove[engine] ({error})") from None
    config = bench_engine.EngineConfig(
        model=args.model, prompt_tokens=args.prompt_tokens,
        decode_batch_sizes=tuple(args.decode_batch_sizes), context_tokens=args.context_tokens,
        iters=args.iters)
    report = bench_engine.run(config)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_engine(report))
    return 0


# --- store ----------------------------------------------------------------------------------


def _add_store(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "store", help="KVStore tiers vs memcpy/dd, and TTFT of a stored prefix",
        description="Writes one prompt's KV into the KVStore's host and disk tiers and reads it "
        "back (every byte checked), against memcpy, dd (O_DIRECT) and a plain file in the same "
        "run; then the time to first token of a repeated prompt when recomputed, loaded from "
        "the host tier and loaded from the disk tier, and whether the store's "
        "load-or-recompute decision picked the faster (the TTFT part needs torch).")
    _add_prompt_args(sub)
    sub.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float16",
                     help="KV element type (default float16)")
    sub.add_argument("--dir", default=None, help="where the disk tier and the baselines write "
                     "(default: a temporary directory, removed afterwards)")
    sub.add_argument("--engine-model", default="small",
                     help="engine preset for the TTFT rows (default small)")
    sub.add_argument("--prompt-tokens", type=int, default=2000,
                     help="the repeated prompt's length (default 2000)")
    sub.add_argument("--no-ttft", action="store_true", help="tiers only (no torch needed)")
    sub.add_argument("--iters", type=int, default=3,
                     help="timed runs per row after a warm-up; the median is shown (default 3)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.set_defaults(run=_run_store)


def _run_store(args: argparse.Namespace) -> int:
    from kvmove.bench import store as bench_store
    from kvmove.bench.store_report import format_store

    if args.dir is not None and not os.path.isdir(args.dir):
        raise ConfigError(f"--dir {args.dir!r} is not a directory")
    if not args.no_ttft:
        try:
            from kvmove.engine.model import MODEL_PRESETS
        except ImportError as error:
            raise ConfigError(f"the TTFT rows need the engine's dependencies: pip install "
                              f"kvmove[engine], or pass --no-ttft ({error})") from None
        if args.engine_model not in MODEL_PRESETS:
            raise ConfigError(f"--engine-model must be one of {list(MODEL_PRESETS)}, got "
                              f"{args.engine_model!r}")
    config = bench_store.StoreBenchConfig(
        model=args.model, tokens=args.tokens, block_size=args.block_size, dtype=args.dtype,
        iters=args.iters, directory=args.dir,
        engine_model=None if args.no_ttft else args.engine_model,
        prompt_tokens=args.prompt_tokens)
    report = bench_store.run(config)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_store(report))
    return 0


# --- serve ----------------------------------------------------------------------------------


def _add_serve(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "serve", help="the article, measured: one trace against each serving mode",
        description="Replays one seeded Poisson trace of long-prompt/short-output and "
        "short-prompt/long-output requests against kvmove-serve in each mode, with the "
        "official openai client, on the same number of worker processes; reports TTFT, ITL, "
        "decode tokens/s, goodput under a TTFT+ITL SLO and the KV hand-off's share of TTFT.")
    sub.add_argument("--modes", nargs="+", default=["colocated", "chunked", "disagg"],
                     metavar="MODE", help="colocated chunked disagg (default: all three)")
    sub.add_argument("--workers", type=int, default=2,
                     help="worker processes per mode (default 2)")
    sub.add_argument("--prefill", type=int, default=None, help="disagg prefill workers")
    sub.add_argument("--decode", type=int, default=None, help="disagg decode workers")
    sub.add_argument("--model", default="small", help="engine preset or HF directory "
                     "(default small)")
    sub.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (default 256)")
    sub.add_argument("--requests", type=int, default=40, help="requests in the trace (default 40)")
    sub.add_argument("--rate", type=float, default=2.0, help="arrivals per second (default 2)")
    sub.add_argument("--long-fraction", type=float, default=0.5,
                     help="share of long-prompt requests (default 0.5)")
    sub.add_argument("--long-prompt", type=int, default=1024, help="long prompt bytes (1024)")
    sub.add_argument("--long-output", type=int, default=16, help="long requests' max_tokens (16)")
    sub.add_argument("--short-prompt", type=int, default=64, help="short prompt bytes (64)")
    sub.add_argument("--short-output", type=int, default=128,
                     help="short requests' max_tokens (128)")
    sub.add_argument("--ttft-slo", type=float, default=2.0, help="goodput's TTFT bound, s (2)")
    sub.add_argument("--itl-slo", type=float, default=0.1, help="goodput's mean ITL bound, s "
                     "(0.1)")
    sub.add_argument("--url", default=None, help="a running kvmove-serve instead (one mode)")
    sub.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    sub.add_argument("--timeout", type=float, default=120.0,
                     help="deadline of every wait in seconds (default 120)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PREFIX", default=None,
                     help="also write PREFIX-itl.png and PREFIX-queues.png (needs matplotlib)")
    sub.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from kvmove.bench import serve as bench_serve
    from kvmove.bench.serve_report import format_serve, plot_serve

    config = bench_serve.ServeConfig(
        modes=tuple(args.modes), workers=args.workers, prefill=args.prefill,
        decode=args.decode, model=args.model, chunk_size=args.chunk_size,
        num_requests=args.requests, rate=args.rate, long_fraction=args.long_fraction,
        long_prompt_bytes=args.long_prompt, long_output_tokens=args.long_output,
        short_prompt_bytes=args.short_prompt, short_output_tokens=args.short_output,
        ttft_slo=args.ttft_slo, itl_slo=args.itl_slo, seed=args.seed, url=args.url,
        timeout=args.timeout)
    if args.plot:
        _check_plot(args.plot)
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("kvmove-bench serve needs the openai client: pip install openai "
                          "kvmove[serve]") from None
    report = bench_serve.run(config)
    if args.plot:
        plot_serve(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_serve(report))
    return 0


# --- plan -----------------------------------------------------------------------------------


def _add_plan(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("plan", help="cost of one prompt's KV hand-off on each link")
    _add_prompt_args(sub)
    sub.add_argument("--prefill-ms", type=float, default=200.0,
                     help="prefill time of that prompt in ms (default 200)")
    sub.add_argument("--link", type=_link_arg, action="append", default=[], metavar="NAME=GBps",
                     help="add a link (repeatable); a default's name replaces that default")
    sub.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float16",
                     help="KV element type (default float16)")
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


if __name__ == "__main__":
    raise SystemExit(main())
