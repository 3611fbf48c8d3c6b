"""``kvmove-bench transfer --against nixl``'s results: NIXL's rows and round trip, measured in
the same run as kvmove's on the same workload, as plain data (``to_dict``, in ``--json``) and
as the text lines that put kvmove's figure, NIXL's and kvmove / NIXL side by side."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvmove.bench.report import RoundTrip, aligned

__all__ = ["AGAINST", "APIS", "KVMoveRow", "NixlRoundTrip", "NixlRow", "NixlRun",
           "nixl_lines"]

# The libraries --against takes (one per run).
AGAINST = ("nixl", "mooncake")
# The two ways NIXL's descriptor lists are prepared (nixl_side.NixlSide.descriptors): one
# descriptor per (layer, block), as NIXL's connectors did; NIXL 1.5's strided lists, one per
# layer, as vLLM's NixlConnector does since vllm#55157. kvmove is compared with the better.
APIS = ("per-block", "strided")

# What NIXL is asked to do, for the text and the JSON (nixl_side.py says why).
NIXL_METHOD = (
    "the same cache memory registered once, its descriptor lists prepared once on each side "
    "(prep_xfer_dlist: one descriptor per (layer, block), or NIXL 1.5's strided lists, one "
    "per layer), and per transfer make_prepped_xfer + transfer + check_xfer_state until "
    "done, all timed; NIXL merges descriptors contiguous on both sides as kvmove coalesces "
    "runs")


@dataclass(frozen=True, slots=True)
class NixlRow:
    """NIXL's best timed iteration of one kvmove row's workload: the same op, placement,
    block size, block ids and bytes. Seconds run from ``make_prepped_xfer`` until
    ``check_xfer_state`` said done; ``post_seconds`` is the ``transfer`` call alone;
    ``num_descs`` is NIXL's descriptor count after merging (its telemetry)."""

    op: str
    placement: str
    block_size: int
    nbytes: int
    num_blocks: int
    num_descs: int
    make_seconds: float
    post_seconds: float
    total_seconds: float
    iter_seconds: tuple[float, ...]
    warmup_seconds: float
    mismatched_blocks: int
    api: str = APIS[0]            # how its descriptor lists were prepared (APIS)
    prep_seconds: float = 0.0     # preparing both lists on the near side, once per block size

    @property
    def key(self) -> tuple[str, str, int]:
        return self.op, self.placement, self.block_size

    @property
    def verified(self) -> bool:
        return self.mismatched_blocks == 0

    @property
    def gbytes_per_s(self) -> float:
        return self.nbytes / self.total_seconds / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verified": self.verified, "gbytes_per_s": self.gbytes_per_s}


class KVMoveRow(Protocol):
    """What the comparison reads of one of kvmove's rows (``transfer_report.TransferRow``,
    which imports this module: a Protocol here keeps the import one-way)."""

    @property
    def cache(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def placement(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def num_ops(self) -> int: ...
    @property
    def gbytes_per_s(self) -> float: ...


# NIXL's one-block round trip (one prepared request, posted again each time: NIXL's fastest
# small write) is measured and reported as kvmove's.
NixlRoundTrip = RoundTrip


@dataclass(frozen=True, slots=True)
class NixlRun:
    """Everything NIXL did in one run: which NIXL (``version``: distribution and version),
    its rows (native-cache rows of every block size and placement) and its round trip."""

    version: str
    rows: tuple[NixlRow, ...]
    round_trip: NixlRoundTrip
    skipped: str | None = None   # why a way of APIS has no rows (an older NIXL)

    @property
    def verified(self) -> bool:
        return all(row.verified for row in self.rows)

    def rows_for(self, row: KVMoveRow) -> dict[str, NixlRow]:
        """NIXL's rows of kvmove's ``row``, by way (APIS); none for a wrapped cache's row:
        NIXL moves the native cache only."""
        if row.cache != "native":
            return {}
        return {r.api: r for r in self.rows
                if r.key == (row.op, row.placement, row.block_size)}

    def row_for(self, row: KVMoveRow) -> NixlRow | None:
        """NIXL's better row of kvmove's ``row`` (the faster of its ways), or None."""
        rows = self.rows_for(row).values()
        return max(rows, key=lambda r: r.gbytes_per_s, default=None)

    def ratio(self, row: KVMoveRow) -> float | None:
        """kvmove's GB/s over NIXL's for the same workload (above 1: kvmove faster)."""
        nixl = self.row_for(row)
        return None if nixl is None else row.gbytes_per_s / nixl.gbytes_per_s

    def round_trip_ratio(self, trip: RoundTrip) -> float:
        """kvmove's one-way time over NIXL's (below 1: kvmove faster)."""
        return trip.one_way_us / self.round_trip.one_way_us

    def to_dict(self, trip: RoundTrip) -> dict[str, Any]:
        return {"library": "nixl", "version": self.version, "method": NIXL_METHOD,
                "apis": list(APIS), "skipped": self.skipped,
                "verified": self.verified, "rows": [row.to_dict() for row in self.rows],
                "round_trip": self.round_trip.to_dict(),
                "round_trip_time_ratio": self.round_trip_ratio(trip)}


def nixl_lines(run: NixlRun, rows: tuple[KVMoveRow, ...], trip: RoundTrip,
               setting: str) -> list[str]:
    """The comparison: per kvmove row with a NIXL row, both GB/s and kvmove / NIXL; then
    the one-block round trip of each. ``setting``: the transports and error mode both ran
    with, as the header says them."""
    head = ["op", "placement", "block", "bytes", "kvmove ops", "kvmove GB/s", "NIXL descs",
            "NIXL GB/s", "strided GB/s", "kvmove / best NIXL", "NIXL verified"]
    cells = []
    for row in rows:
        ways, nixl = run.rows_for(row), run.row_for(row)
        if nixl is not None:
            speeds = [f"{ways[api].gbytes_per_s:.2f}" if api in ways else "-" for api in APIS]
            cells.append([row.op, row.placement, str(row.block_size), f"{row.nbytes:,}",
                          f"{row.num_ops:,}", f"{row.gbytes_per_s:.2f}", f"{nixl.num_descs:,}",
                          *speeds, f"{run.ratio(row):.2f}",
                          "yes" if all(w.verified for w in ways.values()) else "NO"])
    preps = {api: min((r.prep_seconds for r in run.rows if r.api == api), default=None)
             for api in APIS}
    prep_line = ("NIXL's descriptor lists, prepared once per block size (what its first "
                 "request waits for): " + ", ".join(
                     f"{api} {1e3 * seconds:.1f} ms" for api, seconds in preps.items()
                     if seconds is not None)
                 + (f" ({run.skipped})" if run.skipped else ""))
    nixl_trip = run.round_trip
    header = (f"against {run.version} in this run ({setting}, NIXL's UCX backend, no NIXL "
              f"progress thread): {NIXL_METHOD}; best of the same iterations, every byte "
              "verified:")
    trip_line = (f"one-block write + notification, one way ({trip.nbytes:,} B, median of "
                 f"{nixl_trip.iterations}): kvmove {trip.one_way_us:.1f} us, NIXL "
                 f"{nixl_trip.one_way_us:.1f} us (one prepared request, posted again each "
                 f"time): kvmove / NIXL time {run.round_trip_ratio(trip):.2f} (below 1: kvmove "
                 "faster)")
    return [*textwrap.wrap(header, width=100), *aligned(head, cells, left={0, 1, len(head) - 1}),
            *textwrap.wrap(prep_line, width=100), *textwrap.wrap(trip_line, width=100)]
