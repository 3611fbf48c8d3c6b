"""``kvmove-bench engine``: what the engine's Llama costs on this machine, prefill against
decode (the asymmetry that makes disaggregation worth it); the subcommand prints the text of
it below, or ``EngineReport.to_dict()`` as JSON.

``LlamaForCausalLM.forward`` runs directly against a ``KVCache`` (no scheduler), with random
weights of a ``MODEL_PRESETS`` model. Each row is the median of ``iters`` timed iterations
after one untimed warm-up:

* **prefill**: one prompt of ``prompt_tokens`` (the headline number), then
  ``prefill_batch_sizes`` prompts of ``batch_prompt_tokens`` each in one forward. A prompt
  already gives every matmul hundreds of rows, so the CPU is busy computing and more prompts
  per forward hardly raise tokens/s.
* **decode**: ``decode_steps`` steps of one new token per sequence at each of
  ``decode_batch_sizes``, every sequence with ``context_tokens`` already in the cache. A step
  reads every weight once however many sequences share it, so tokens/s grows with the batch
  until the compute catches up.

Ratios are against batch 1 measured in the same run. Prompts are random token ids from
``seed``. The decode context is one real prefill of ``context_tokens`` copied into every
sequence's own blocks: the values do not change a step's cost, and copying spares a prefill
of ``batch x context_tokens`` tokens. Torch keeps its default thread count; the report
records it.

This module (the subcommand) and ``engine_report`` (the configuration, the rows and their text)
need no torch (``kvmove-bench``'s other subcommands import them); the measuring half, which
does, is ``engine_rig``.
"""

from __future__ import annotations

import argparse
import json

from kvmove.bench.engine_report import EngineConfig, count_steps, format_engine
from kvmove.bench.progress import bar
from kvmove.errors import ConfigError

__all__ = ["add_parser", "run_command"]


# --- the subcommand -------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    try:  # torch is the engine's, not the core's
        from kvmove.bench import engine_rig
    except ImportError as error:
        raise ConfigError(f"kvmove-bench engine needs the engine's dependencies: pip install "
                          f"kvmove[engine] ({error})") from None
    config = EngineConfig(
        model=args.model, prompt_tokens=args.prompt_tokens,
        decode_batch_sizes=tuple(args.decode_batch_sizes), context_tokens=args.context_tokens,
        iters=args.iters)
    with bar(args, count_steps(config)) as progress:
        report = engine_rig.run(config, progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_engine(report))
    return 0
