"""``kvmove-bench``: plan and measure KV-cache hand-offs between prefill and decode nodes.

Subcommands:
    transfer  (default) moves one prompt's KV cache between two processes with kvmove, verifies
              every byte, and compares the bandwidth with memcpy and ``ucx_perftest`` measured
              in the same run, then with the article's links; ``--against nixl`` (or
              ``mooncake``, or both: the option twice) runs the same workload through NIXL
              (or Mooncake's transfer engine) too and prints kvmove / it per row.
    stream    how much of that hand-off layer-wise streaming hides behind a (simulated) prefill:
              bulk vs streamed, between two processes, every byte verified.
    scale     what concurrent leases (1 ... 1,000) and peers (1 ... 32) cost one agent: time
              per lease, connect time, memory per peer, GB/s with every peer streaming.
    classes   a hand-off's latency beside an offload stream of 10x its bytes, with traffic
              classes and without, in one run.
    engine    the reference engine's prefill and decode throughput on this machine, and the
              asymmetry: decode gains from batching, prefill does not (needs torch).
    store     the KVStore's host and disk tiers against memcpy / dd / a plain file, and the
              time to first token of a repeated prompt: recompute vs host hit vs disk hit.
    serve     one seeded request trace against kvmove-serve in each mode (colocated, chunked,
              disagg): TTFT, ITL, throughput, goodput (needs kvmove[serve] and openai).
    soak      kvmove-serve disaggregated under steady load with faults, stalls and kills:
              requests served, errors by kind, wrong answers, blocks leaked, memory over time.
    plan      what moving one prompt's KV cache costs on each link, and whether to disaggregate
              (arithmetic from the model's layout; nothing is sent).

With no subcommand, or options only, ``DEFAULT_COMMAND`` runs. Bad input exits with status 2
and a message on stderr naming the value; a failed or unverified transfer exits with 1.
``--version`` prints ``kvmove.__version__``; ``--log-level`` (before or after the subcommand)
sets kvmove's log level, C++ core included, and sends its records to stderr. Progress goes
to stderr too (``kvmove.bench.progress``), so stdout holds the report alone.

Each subcommand is its benchmark's module: its ``add_parser`` registers it and sets ``run``,
which this module calls.
"""

from __future__ import annotations

import argparse
import os
import sys

import kvmove
from kvmove import _log
from kvmove.bench import classes, engine, plan, scale, serve, soak, store, stream, transfer
from kvmove.errors import ConfigError, KVMoveError

# In the order ``--help`` lists them.
SUBCOMMANDS = (transfer, stream, scale, classes, engine, store, serve, soak, plan)

# The subcommand that runs when none is given.
DEFAULT_COMMAND = "transfer"


def main(argv: list[str] | None = None) -> int:
    """Run ``kvmove-bench``; returns the exit status (argparse errors raise ``SystemExit(2)``)."""
    parser = _parser()
    args = parser.parse_args(_with_default_command(sys.argv[1:] if argv is None else argv))
    _log.configure_cli(args.log_level)
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
    """Insert ``DEFAULT_COMMAND`` after a leading ``--log-level`` unless what follows is a
    subcommand or asks for help or the version."""
    head = _log_level_prefix(argv)
    rest = argv[head:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help", "--version")):
        return [*argv[:head], DEFAULT_COMMAND, *rest]
    return list(argv)


def _log_level_prefix(argv: list[str]) -> int:
    """How many leading items of ``argv`` are ``--log-level LEVEL`` (or ``--log-level=LEVEL``)."""
    if argv[:1] == ["--log-level"]:
        return 2
    return 1 if argv and argv[0].startswith("--log-level=") else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmove-bench",
        description="Plan and measure KV-cache hand-offs between prefill and decode nodes.",
        epilog=f"With no subcommand, '{DEFAULT_COMMAND}' runs.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvmove.__version__}")
    _add_log_level(parser, None)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for benchmark in SUBCOMMANDS:
        benchmark.add_parser(commands)
    for sub in commands.choices.values():
        # SUPPRESS: a subcommand's default must not overwrite a --log-level given before it.
        _add_log_level(sub, argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--log-level", choices=list(_log.LEVELS), default=default,
                        help="kvmove's log level, C++ core included, on stderr (default: "
                        "$KVMOVE_LOG_LEVEL, else warning)")


if __name__ == "__main__":
    raise SystemExit(main())
