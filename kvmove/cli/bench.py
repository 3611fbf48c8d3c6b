"""``kvmove-bench``: plan and measure KV-cache hand-offs between prefill and decode nodes.

Subcommands:
    plan    what moving one prompt's KV cache costs on each link, and whether to disaggregate
            (arithmetic from the model's layout; nothing is sent).

With no subcommand, or options only, ``DEFAULT_COMMAND`` runs. Bad input exits with status 2
and a message on stderr naming the value.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvmove.errors import ConfigError
from kvmove.layout import DTYPE_BYTES, PRESETS, KVLayout
from kvmove.plan import DEFAULT_LINKS, Link, Plan, merge_links, parse_link, plan

# The subcommand that runs when none is given; a later `transfer` takes over by changing this.
DEFAULT_COMMAND = "plan"


def main(argv: list[str] | None = None) -> int:
    """Run ``kvmove-bench``; returns the exit status (argparse errors raise ``SystemExit(2)``)."""
    parser = _parser()
    args = parser.parse_args(_with_default_command(sys.argv[1:] if argv is None else argv))
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2


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
    _add_plan(commands)
    return parser


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
    widths = [max(len(cells[i]) for cells in [head, *rows]) for i in range(len(head))]
    # Names and verdicts read left to right; numbers line up on the right.
    return ["  ".join(cell.ljust(w) if i in (0, len(head) - 1) else cell.rjust(w)
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
