"""Serving benchmark: one seeded request trace replayed against ``kvmove-serve`` in each mode
(colocated, chunked prefill, disaggregated prefill/decode). This module holds the run and the
subcommand; ``serve_config`` the configuration, ``serve_trace`` the trace, ``serve_load`` its
replay, ``serve_server`` kvmove-serve as a process, ``serve_report`` the results, their text
and plots.

The trace mixes two kinds of request, in exact proportion and shuffled:

* **long** (summarisation-like): a long prompt, a short answer — prefill-heavy;
* **short** (chat-like): a short prompt, a long answer — decode-heavy.

Arrivals are a Poisson process (exponential gaps at ``rate`` per second, the first at 0).
Prompts are ASCII, so their length in bytes is their length in tokens minus the BOS with the
presets' byte tokenizer; each begins with its request's index so that no two share a first
KV block and prefix reuse cannot skip a prefill. Every mode gets the same trace.

Per mode a fresh server starts (its own session, a free port), the trace is replayed with the
official ``openai`` client (streaming, ``ignore_eos`` so every request yields exactly
``max_tokens``), ``/metrics`` is sampled every ``sample_interval`` for the per-pool queue
lengths, and the server is stopped with SIGTERM (SIGKILL to its whole session after the
deadline; anything of it still alive after it exits is killed too).

What a request records, on the client's ``time.monotonic()``: when it was sent and when each
token's chunk arrived. A chunk carries a token unless it has a ``finish_reason`` (the closing
chunk, as OpenAI's, carries none); a token that ends inside a UTF-8 character arrives as a chunk
with empty text and still counts. TTFT is sent -> first token chunk; ITLs are the gaps between
token chunks. Goodput counts requests that finished with every token, TTFT <= ``ttft_slo`` and
mean ITL (time per output token after the first) <= ``itl_slo``: the mean, as DistServe and
vLLM's benchmark define it, because one stall of this shared CPU would otherwise disqualify a
request; the stalls themselves show in ITL p99 and max.

The KV hand-off share (disagg) is the server's ``kvmove_kv_handoff_seconds`` mean over the
client's mean TTFT: per request, from the prefill's last layer computed to the decode worker
seeing the KV (and first token) in; the report's timeline line gives each stage's mean
(``kvmove_kv_handoff_stage_seconds``, docs/serving.md). ``kvmove_kv_exposed_seconds`` (the
last layer posted to landed) and ``kvmove_kv_transfer_seconds`` (first layer posted to last
landed, mostly hidden behind the prefill's compute) are the byte transfer's parts.

Defaults: the ``small`` preset (8 layers, hidden 512), where on the 2-core CI machine a
1,025-token prefill takes ~1.4 s and a decode step 15-30 ms (one core per worker): prefill far
costlier than a decode step, which is what makes colocated decode stall. ``tiny`` is
overhead-bound (its decode step costs less than the HTTP chunk it produces), so it would
compare the router, not the modes. 40 requests at 2/s, half of each kind, load two workers to
the knee, where the modes part. Measured on the quiet machine: the whole default run in 94-96
s (each server ready in 4-5 s, each replay 24-28 s); 132 s while another job's servers shared
the cores, which also pushed every mode past its SLOs. At the default load colocated's ITL p99
was ~1.7 s (decodes behind whole prefills), chunked's ~0.34 s, disagg's ~0.1 s, while its one
prefill worker queued prompts (TTFT p50 ~3 s against ~1-2 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from kvmove.bench.options import check_plot
from kvmove.bench.progress import Progress, bar
from kvmove.bench.serve_config import MODES, PLANNERS, ROUTINGS, ServeBenchConfig
from kvmove.bench.serve_load import replay
from kvmove.bench.serve_report import ModeResult, ServeReport, format_serve, plot_serve
from kvmove.bench.serve_server import ServerProcess, serve_arguments
from kvmove.bench.serve_trace import TraceRequest, make_trace
from kvmove.errors import ConfigError
from kvmove.serve.config import Mode

__all__ = ["add_parser", "count_steps", "run", "run_command"]

logger = logging.getLogger(__name__)

# --- the run --------------------------------------------------------------------------------


def _run_mode(config: ServeBenchConfig, mode: str, routing: str, planner: str,
              trace: Sequence[TraceRequest], progress: Progress) -> ModeResult:
    if config.url is not None:
        progress(f"{mode}: using {config.url}")
        result = asyncio.run(replay(config, trace, config.url.rstrip("/"), mode, progress))
        progress(f"{mode}: done")
        return result
    with ServerProcess(serve_arguments(config, mode, routing, planner == "on"),
                       config.timeout) as server:
        logger.info("kvmove-serve %s ready on %s in %.1f s", mode, server.url,
                    server.startup_seconds)
        progress(f"{mode}: server ready")
        result = asyncio.run(replay(config, trace, server.url, mode, progress))
    progress(f"{mode}: server stopped")
    return replace(result, startup_seconds=server.startup_seconds, exit_code=server.exit_code,
                   routing=routing if len(config.routings) > 1 else None,
                   planner=planner == "on")


def run(config: ServeBenchConfig, progress: Progress | None = None) -> ServeReport:
    """Replays one trace against each of ``config.modes`` (a fresh server each).

    Raises:
        BenchError: a server did not start in time, or exited before it was ready.
    """
    progress = progress or (lambda label: None)
    wall = time.perf_counter()
    trace = make_trace(config)
    modes = tuple(_run_mode(config, mode, routing, planner, trace, progress)
                  for mode, routing, planner in _runs(config))
    return ServeReport(config, trace, modes, time.perf_counter() - wall)


def _runs(config: ServeBenchConfig) -> list[tuple[str, str, str]]:
    """(mode, routing, planner) of each server ``run`` starts, in order."""
    return [(mode, routing, planner) for mode in config.modes for routing in config.routings
            for planner in (config.planners if mode == Mode.DISAGG else ("off",))]


def count_steps(config: ServeBenchConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    return len(_runs(config)) * (config.num_requests + 2)


# --- the subcommand -------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "serve", help="the article, measured: one trace against each serving mode",
        description="Replays one seeded Poisson trace of long-prompt/short-output and "
        "short-prompt/long-output requests against kvmove-serve in each mode, with the "
        "official openai client, on the same number of worker processes; reports TTFT, ITL, "
        "decode tokens/s, goodput under a TTFT+ITL SLO and the KV hand-off's share of TTFT.")
    sub.add_argument("--modes", nargs="+", default=list(MODES),
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
    sub.add_argument("--routing", nargs="+", choices=ROUTINGS, default=["kv"],
                     help="kvmove-serve --routing; several: each mode once per routing, "
                     "compared in one run (default kv)")
    sub.add_argument("--shared-prefixes", type=int, default=0, metavar="N",
                     help="prompts begin with one of N shared prefixes (default 0: none); "
                     "the report gives the TTFT of their repeats")
    sub.add_argument("--prefix-bytes", type=int, default=512,
                     help="a shared prefix's length, before the prompt's own (default 512)")
    sub.add_argument("--planner", nargs="+", choices=PLANNERS, default=["off"],
                     help="disagg with kvmove-serve --planner ('on'), without ('off'), or both "
                     "compared in one run: 'off on' (default off)")
    sub.add_argument("--prefill-workers", default=None, metavar="MIN:MAX",
                     help="the planner's prefill pool bounds (kvmove-serve's default: 1 to "
                     "twice the starting size)")
    sub.add_argument("--decode-workers", default=None, metavar="MIN:MAX",
                     help="the planner's decode pool bounds")
    sub.add_argument("--url", default=None, help="a running kvmove-serve instead (one mode)")
    sub.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    sub.add_argument("--timeout", type=float, default=120.0,
                     help="deadline of every wait in seconds (default 120)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PREFIX", default=None,
                     help="also write PREFIX-itl.png and PREFIX-queues.png (needs matplotlib)")
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    config = ServeBenchConfig(
        modes=tuple(args.modes), workers=args.workers, prefill=args.prefill,
        decode=args.decode, model=args.model, chunk_size=args.chunk_size,
        num_requests=args.requests, rate=args.rate, long_fraction=args.long_fraction,
        long_prompt_bytes=args.long_prompt, long_output_tokens=args.long_output,
        short_prompt_bytes=args.short_prompt, short_output_tokens=args.short_output,
        ttft_slo=args.ttft_slo, itl_slo=args.itl_slo, seed=args.seed, url=args.url,
        routings=tuple(args.routing), shared_prefixes=args.shared_prefixes,
        prefix_bytes=args.prefix_bytes, planners=tuple(args.planner),
        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
        timeout=args.timeout)
    if args.plot:
        check_plot(args.plot)
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("kvmove-bench serve needs the openai client: pip install openai "
                          "kvmove[serve]") from None
    with bar(args, count_steps(config)) as progress:
        report = run(config, progress)
    if args.plot:
        plot_serve(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_serve(report))
    return 0
