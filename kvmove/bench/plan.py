"""Disaggregation planner: what moving one prompt's KV cache costs on each link, and the advice.

Pure arithmetic, no I/O (the ``kvmove-bench plan`` subcommand at the end prints it). For a
model layout, a prompt length and a prefill time (given, or estimated by ``prefill.py`` from
the model's FLOPs), ``plan`` gives per link the transfer time,
its share of the prefill, the part still exposed when layers are streamed as they are
computed, a ``Verdict``, and advice lines that follow DESIGN.md §1's "when to disaggregate"
table. Llama-3.1-8B, 4,000 tokens, 200 ms prefill::

    link             GB/s  transfer ms  % of prefill  exposed ms (streamed)  verdict
    NVLink            900        0.583          0.3%                  0.018  cheap
    InfiniBand 400G    50        10.49          5.2%                  0.328  cheap
    Ethernet 25G      3.1       169.13         84.6%                   5.29  too_slow
"""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from kvmove.bench import prefill as prefill_estimate
from kvmove.bench.model_shapes import ModelChoice, resolve_model
from kvmove.bench.options import add_prompt_args, check_plot
from kvmove.bench.prefill import PrefillEstimate
from kvmove.bench.report import aligned, human_bytes, ms, pyplot, save_figure
from kvmove.errors import ConfigError
from kvmove.kv_spec import DTYPE_BYTES, KVSpec
from kvmove.validation import require_positive_finite, require_positive_int

__all__ = [
    "CHEAP_SHARE_PCT", "DEFAULT_LINKS", "TOO_SLOW_SHARE_PCT", "Link", "LinkRow", "Plan",
    "Verdict", "add_parser", "exposed_ms", "format_plan", "merge_links", "parse_link", "plan",
    "run_command", "transfer_ms", "verdict_for",
]

# Verdicts judge the share of the prefill that the *whole* transfer takes, not the part left
# exposed by streaming, because that share is also the link's duty cycle when a prefill worker
# runs back to back: streaming hides latency, never bandwidth.
# - <= 10 %: even unstreamed, TTFT grows by at most a tenth (about the run-to-run noise of TTFT
#   on a shared cluster), and the link idles 90 % of the time, so concurrent hand-offs rarely
#   queue behind each other.
# - > 50 %: unstreamed, TTFT grows by half or more, and a link busy over half the time queues
#   hand-offs (M/D/1 waits grow as rho / (1 - rho)); the interference disaggregation removes
#   (ITL p99 stalls) rarely buys that back. Ethernet 25G with Llama-3.1-8B lands at ~85 %.
# - in between: it pays only with layer-wise streaming and a real ITL p99 problem.
CHEAP_SHARE_PCT = 10.0
TOO_SLOW_SHARE_PCT = 50.0


class Verdict(enum.Enum):
    """How a link's transfer compares with the prefill it follows."""

    CHEAP = "cheap"
    MARGINAL = "marginal"
    TOO_SLOW = "too_slow"


@dataclass(frozen=True, slots=True)
class Link:
    """An interconnect between a prefill and a decode node.

    Args:
        name: what the user calls it, e.g. "InfiniBand 400G".
        gbytes_per_s: usable bandwidth in GB/s (1 GB = 1e9 bytes), not Gb/s.
    """

    name: str
    gbytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"link name must be a non-empty string, got {self.name!r}")
        require_positive_finite(f"gbytes_per_s of link {self.name!r}", self.gbytes_per_s)


# DESIGN.md §1's table: NVLink in a node, 400 Gb/s RDMA, 25 Gb/s Ethernet (after overheads).
DEFAULT_LINKS: tuple[Link, ...] = (
    Link("NVLink", 900.0),
    Link("InfiniBand 400G", 50.0),
    Link("Ethernet 25G", 3.1),
)


def parse_link(text: str) -> Link:
    """Parse ``"NAME=GBps"`` (e.g. ``"RoCE 100G=12.5"``) into a ``Link``.

    The last ``=`` splits, so a name may not contain one but may contain spaces.
    """
    name, sep, rate = text.rpartition("=")
    if not sep or not name.strip():
        raise ConfigError(f"link must look like NAME=GBps (e.g. 'RoCE=12.5'), got {text!r}")
    try:
        gbytes_per_s = float(rate)
    except ValueError:
        raise ConfigError(
            f"link bandwidth must be a number of GB/s, got {rate!r} in {text!r}"
        ) from None
    return Link(name.strip(), gbytes_per_s)


def merge_links(base: tuple[Link, ...], extra: list[Link] | tuple[Link, ...]) -> tuple[Link, ...]:
    """``base`` plus ``extra``; an extra link named like a base link replaces it in place.

    We replace rather than reject so ``--link NVLink=450`` can correct a default to the
    bandwidth a user measured.
    """
    merged = {link.name: link for link in base}
    merged.update((link.name, link) for link in extra)
    return tuple(merged.values())


def transfer_ms(nbytes: int, link: Link) -> float:
    """Milliseconds to move ``nbytes`` at the link's full bandwidth."""
    return nbytes / (link.gbytes_per_s * 1e9) * 1e3


def exposed_ms(transfer_ms: float, prefill_ms: float, num_layers: int) -> float:
    """Transfer time still running after the prefill ends, under layer-wise streaming.

    Model: L = num_layers equal layers, t = transfer_ms, p = prefill_ms. Layer i's compute ends
    at (i+1)·p/L; its t/L of transfer starts then, serialized on the link::

        compute |--0--|--1--|--2--|--3--|
        link          |0|   |1|   |2|   |3|               t <= p: the link keeps up
        link          |---0---|---1---|---2---|---3---|   t >  p: the link is the bottleneck

    - t <= p: each layer's send ends before the next layer is computed, so only the last
      layer's t/L sticks out: exposed = t/L.
    - t > p: from p/L on the link never idles, the last byte lands at p/L + t, so
      exposed = p/L + t - p = t/L + (t - p)·(L-1)/L.

    Both: exposed = t/L + max(0, t - p)·(L-1)/L. It ignores per-post overhead and assumes the
    link is this request's alone, so it is a lower bound.
    """
    per_layer = transfer_ms / num_layers
    return per_layer + max(0.0, transfer_ms - prefill_ms) * (num_layers - 1) / num_layers


def verdict_for(share_pct: float) -> Verdict:
    """The verdict for a transfer taking ``share_pct`` percent of the prefill time."""
    if share_pct <= CHEAP_SHARE_PCT:
        return Verdict.CHEAP
    if share_pct <= TOO_SLOW_SHARE_PCT:
        return Verdict.MARGINAL
    return Verdict.TOO_SLOW


@dataclass(frozen=True, slots=True)
class LinkRow:
    """One link's cost for one prompt; times in ms, ``prefill_share_pct`` in percent."""

    link: Link
    transfer_ms: float
    prefill_share_pct: float
    exposed_ms: float
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.link.name,
            "gbytes_per_s": self.link.gbytes_per_s,
            "transfer_ms": self.transfer_ms,
            "prefill_share_pct": self.prefill_share_pct,
            "exposed_ms": self.exposed_ms,
            "verdict": self.verdict.value,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    """What moving one prompt's KV cache costs on each link, and what to do about it.

    ``kv_bytes`` counts the prompt's tokens exactly (``layout.bytes_for``), not the padding of
    its last, partly filled block. ``prefill`` says where ``prefill_ms`` came from.
    """

    model: str | None
    layout: KVSpec
    num_tokens: int
    prefill_ms: float
    prefill: PrefillEstimate
    kv_bytes: int
    bytes_per_token: int
    num_blocks: int
    rows: tuple[LinkRow, ...]
    advice: tuple[str, ...]

    def row(self, name: str) -> LinkRow:
        """The row of the link called ``name``."""
        for row in self.rows:
            if row.link.name == name:
                return row
        known = ", ".join(repr(row.link.name) for row in self.rows)
        raise ConfigError(f"no link named {name!r} in this plan; links: {known}")

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready types."""
        return {
            "model": self.model,
            "layout": asdict(self.layout),
            "num_tokens": self.num_tokens,
            "prefill_ms": self.prefill_ms,
            "prefill": self.prefill.to_dict(),
            "kv_bytes": self.kv_bytes,
            "bytes_per_token": self.bytes_per_token,
            "num_blocks": self.num_blocks,
            "thresholds": {"cheap_share_pct": CHEAP_SHARE_PCT,
                           "too_slow_share_pct": TOO_SLOW_SHARE_PCT},
            "links": [row.to_dict() for row in self.rows],
            "advice": list(self.advice),
        }


def plan(
    layout: KVSpec,
    num_tokens: int,
    prefill_ms: float = 200.0,
    links: tuple[Link, ...] | list[Link] = DEFAULT_LINKS,
    *,
    model: str | None = None,
    prefill: PrefillEstimate | None = None,
) -> Plan:
    """Cost each link for moving ``num_tokens`` tokens of KV cache after a ``prefill_ms`` prefill.

    Args:
        layout: the model's KV layout, e.g. ``KVSpec.preset("llama-3.1-8b")``.
        num_tokens: prompt length in tokens, > 0.
        prefill_ms: time the prefill takes, > 0 and finite.
        links: links to compare, names unique.
        model: the model's name, only for display.
        prefill: where ``prefill_ms`` came from (``kvmove.bench.prefill``); default: given.

    Raises:
        ConfigError: naming the bad value.
    """
    require_positive_int("num_tokens", num_tokens)
    require_positive_finite("prefill_ms", prefill_ms)
    _require_links(links)
    kv_bytes = layout.bytes_for(num_tokens)
    rows = tuple(_row(link, kv_bytes, float(prefill_ms), layout.num_layers) for link in links)
    return Plan(
        model=model,
        layout=layout,
        num_tokens=num_tokens,
        prefill_ms=float(prefill_ms),
        prefill=prefill or prefill_estimate.given(prefill_ms),
        kv_bytes=kv_bytes,
        bytes_per_token=layout.bytes_per_token,
        num_blocks=layout.blocks_for(num_tokens),
        rows=rows,
        advice=_advice(rows, float(prefill_ms)),
    )


def _row(link: Link, kv_bytes: int, prefill_ms: float, num_layers: int) -> LinkRow:
    t = transfer_ms(kv_bytes, link)
    share_pct = t / prefill_ms * 100.0
    exposed = exposed_ms(t, prefill_ms, num_layers)
    return LinkRow(link, t, share_pct, exposed, verdict_for(share_pct))


def _advice(rows: tuple[LinkRow, ...], prefill_ms: float) -> tuple[str, ...]:
    """DESIGN.md §1's "when to disaggregate" table, applied to these links' verdicts."""
    by_verdict = {v: [row for row in rows if row.verdict is v] for v in Verdict}
    lines = []
    if slow := by_verdict[Verdict.TOO_SLOW]:
        lines.append(f"don't disaggregate over {_names(slow)}: the transfer eats the gain "
                     f"against a {prefill_ms:.4g} ms prefill (streaming hides latency, not "
                     f"bandwidth)")
    if marginal := by_verdict[Verdict.MARGINAL]:
        lines.append(f"{_names(marginal)}: marginal — disaggregate only with layer-wise "
                     f"streaming and only if ITL p99 misses its target")
    if cheap := by_verdict[Verdict.CHEAP]:
        lines.append(f"{_names(cheap)}: the transfer is cheap — consider disaggregation at scale "
                     f"(tens of GPUs with RDMA); with few GPUs and moderate traffic chunked "
                     f"prefill is enough")
    viable = cheap + marginal
    if not viable:
        lines.append("no link here is fast enough: stay colocated, and if ITL p99 misses its "
                     "target use chunked prefill")
        return tuple(lines)
    fastest = min(viable, key=lambda row: row.transfer_ms).link.name
    lines.append(f"if ITL p99 misses its target: chunked prefill first, then disaggregate "
                 f"over {fastest}")
    lines.append(f"extremely skewed input/output lengths: disaggregation over "
                 f"{', '.join(row.link.name for row in viable)} pays most")
    return tuple(lines)


def _names(rows: list[LinkRow]) -> str:
    """``"NVLink (0.3% of prefill), InfiniBand 400G (5.2% of prefill)"``."""
    return ", ".join(f"{row.link.name} ({row.prefill_share_pct:.1f}% of prefill)" for row in rows)


def _require_links(links: tuple[Link, ...] | list[Link]) -> None:
    if not links:
        raise ConfigError("links must hold at least one Link, got none")
    names: set[str] = set()
    for link in links:
        if not isinstance(link, Link):
            raise ConfigError(f"links must hold Link objects, got {link!r}")
        if link.name in names:
            raise ConfigError(f"link names must be unique, got {link.name!r} twice")
        names.add(link.name)


# --- text -----------------------------------------------------------------------------------

def format_plan(result: Plan) -> str:
    """The plan as a header line, one table row per link, and the advice."""
    layout = result.layout
    header = (
        f"{result.model or 'custom layout'} ({layout.num_layers} layers, {layout.num_kv_heads} "
        f"KV heads, head_dim {layout.head_dim}, {layout.dtype}), {result.num_tokens:,} tokens: "
        f"KV {result.kv_bytes:,} B ({human_bytes(result.kv_bytes)}), "
        f"{result.bytes_per_token:,} B/token, {result.num_blocks:,} blocks of "
        f"{layout.block_size}; prefill {result.prefill_ms:.4g} ms ({result.prefill.basis})"
    )
    advice = [f"  - {line}" for line in result.advice]
    return "\n".join([header, "", *_table(result), "", "advice:", *advice])


def _table(result: Plan) -> list[str]:
    head = ["link", "GB/s", "transfer ms", "% of prefill", "exposed ms (streamed)", "verdict"]
    rows = [[row.link.name, f"{row.link.gbytes_per_s:g}", ms(row.transfer_ms),
             f"{row.prefill_share_pct:.1f}%", ms(row.exposed_ms), row.verdict.value]
            for row in result.rows]
    return aligned(head, rows, left={0, len(head) - 1})


# --- the subcommand -------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser("plan", help="cost of one prompt's KV hand-off on each link")
    add_prompt_args(sub, model_paths=True)
    source = sub.add_mutually_exclusive_group()
    source.add_argument("--prefill-ms", type=float, default=None,
                        help="prefill time of that prompt in ms (default: estimated from the "
                        "model's FLOPs on --gpu)")
    source.add_argument("--engine-report", metavar="JSON", default=None,
                        help="estimate the prefill from this machine's measured engine rate: "
                        "a `kvmove-bench engine --json` report")
    sub.add_argument("--gpu", type=_typed(prefill_estimate.parse_accelerator),
                     default=prefill_estimate.DEFAULT_GPU, metavar="NAME",
                     help=f"accelerator of the FLOPs estimate: "
                     f"{', '.join(prefill_estimate.ACCELERATORS)} or NAME=TFLOPS (dense bf16 "
                     f"peak; default %(default)s)")
    sub.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel GPUs sharing the prefill (default 1)")
    sub.add_argument("--utilization", type=float, default=prefill_estimate.DEFAULT_UTILIZATION,
                     help="share of the peak the prefill reaches, assumed (default %(default)s)")
    sub.add_argument("--link", type=_typed(parse_link), action="append", default=[],
                     metavar="NAME=GBps",
                     help="add a link (repeatable); a default's name replaces that default")
    sub.add_argument("--dtype", choices=list(DTYPE_BYTES), default=None,
                     help="KV element type (default: float16 for a preset, the checkpoint's "
                     "dtype for a config.json)")
    sub.add_argument("--json", action="store_true", help="print the plan as JSON only")
    sub.add_argument("--plot", metavar="PNG", default=None,
                     help="also draw transfer time per link against the prefill, as bars, to "
                     "this PNG (needs matplotlib: kvmove[bench])")
    sub.set_defaults(run=run_command)


def _typed(parse: Any) -> Any:
    """``parse`` as an argparse type that keeps our ConfigError message (argparse would say
    "invalid parse_link value")."""
    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse_arg


def run_command(args: argparse.Namespace) -> int:
    if args.plot:
        check_plot(args.plot)
    choice = resolve_model(args.model, args.block_size, args.dtype)
    estimate = _prefill(args, choice)
    links = merge_links(DEFAULT_LINKS, args.link)
    described = choice.arch.describe()
    result = plan(choice.layout, args.tokens, estimate.ms, links,
                  model=f"{choice.name} ({described})" if described else choice.name,
                  prefill=estimate)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    if args.plot:
        plot_plan(result, args.plot)
    return 0


def plot_plan(result: Plan, path: str) -> None:
    """Per link, bars of the whole transfer and of what streaming leaves exposed, beside a
    line at the prefill time (a log scale: links differ by orders of magnitude)."""
    plt = pyplot()
    rows = list(result.rows)
    fig, ax = plt.subplots(figsize=(8, 2.0 + 0.6 * len(rows)))
    where = range(len(rows))
    ax.barh([y + 0.2 for y in where], [r.transfer_ms for r in rows], height=0.4,
            label="transfer, whole prompt (ms)")
    ax.barh([y - 0.2 for y in where], [max(r.exposed_ms, 1e-3) for r in rows], height=0.4,
            label="exposed when streamed layer by layer (ms)")
    ax.axvline(result.prefill_ms, color="black", linestyle="--",
               label=f"prefill {result.prefill_ms:,.0f} ms")
    ax.set_yticks(list(where), [f"{r.link.name} ({r.link.gbytes_per_s:g} GB/s)" for r in rows])
    ax.set(xscale="log", xlabel="ms")
    ax.set_title(f"{result.model or 'KV'}\n{result.num_tokens:,} tokens, "
                 f"{human_bytes(result.kv_bytes)} of KV", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    save_figure(fig, path)


def _prefill(args: argparse.Namespace, choice: ModelChoice) -> PrefillEstimate:
    """--prefill-ms as given, else this machine's engine rate, else FLOPs on --gpu."""
    if args.prefill_ms is not None:
        return prefill_estimate.given(args.prefill_ms)
    if args.engine_report is not None:
        return prefill_estimate.from_engine_report(choice.shape, args.tokens,
                                                   args.engine_report, choice.arch)
    return prefill_estimate.on_accelerator(choice.shape, args.tokens, args.gpu, args.tp,
                                           args.utilization, choice.arch)
