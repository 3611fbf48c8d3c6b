"""``kvmove-bench transfer --against nixl``'s results: NIXL's rows and round trip, measured in
the same run as kvmove's on the same workload, as plain data (``to_dict``, in ``--json``) and
as the text lines that put kvmove's figure, NIXL's and kvmove / NIXL side by side. Also what
every library's results share (``LibraryRow``, ``LibraryRun``, the text's kvmove columns and
round-trip line), which ``mooncake_report`` builds on."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from kvmove.bench.report import RoundTrip, aligned

__all__ = ["AGAINST", "APIS", "KVMOVE_HEAD", "KVMoveRow", "LibraryRow", "LibraryRun",
           "NixlRoundTrip", "NixlRow", "NixlRun", "comparison_lines", "kvmove_cells", "nixl_lines",
           "trip_line"]

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


class LibraryRow:
    """What every library's row (a frozen dataclass with ``op``, ``placement``,
    ``block_size``, ``nbytes``, ``total_seconds`` and ``mismatched_blocks``) derives."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass's, for asdict's type
    op: str
    placement: str
    block_size: int
    nbytes: int
    total_seconds: float
    mismatched_blocks: int

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


@dataclass(frozen=True, slots=True)
class NixlRow(LibraryRow):
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


class LibraryRun:
    """What every library's run (a frozen dataclass with ``version``, ``rows`` and
    ``round_trip``, and its own ``row_for``) derives."""

    __slots__ = ()
    version: str
    rows: tuple[LibraryRow, ...]
    round_trip: RoundTrip

    def row_for(self, row: KVMoveRow) -> LibraryRow | None:
        """The library's row to compare kvmove's ``row`` with, or None."""
        raise NotImplementedError

    @property
    def verified(self) -> bool:
        return all(row.verified for row in self.rows)

    def ratio(self, row: KVMoveRow) -> float | None:
        """kvmove's GB/s over the library's for the same workload (above 1: kvmove
        faster)."""
        other = self.row_for(row)
        return None if other is None else row.gbytes_per_s / other.gbytes_per_s

    def round_trip_ratio(self, trip: RoundTrip) -> float:
        """kvmove's one-way time over the library's (below 1: kvmove faster)."""
        return trip.one_way_us / self.round_trip.one_way_us

    def _to_dict(self, trip: RoundTrip, library: str, method: str,
                 **extra: Any) -> dict[str, Any]:
        """The JSON's ``against``: ``extra`` (the library's own keys) after ``method``."""
        return {"library": library, "version": self.version, "method": method, **extra,
                "verified": self.verified, "rows": [row.to_dict() for row in self.rows],
                "round_trip": self.round_trip.to_dict(),
                "round_trip_time_ratio": self.round_trip_ratio(trip)}


@dataclass(frozen=True, slots=True)
class NixlRun(LibraryRun):
    """Everything NIXL did in one run: which NIXL (``version``: distribution and version),
    its rows (native-cache rows of every block size and placement) and its round trip."""

    version: str
    rows: tuple[NixlRow, ...]
    round_trip: NixlRoundTrip
    skipped: str | None = None   # why a way of APIS has no rows (an older NIXL)

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

    def to_dict(self, trip: RoundTrip) -> dict[str, Any]:
        return self._to_dict(trip, "nixl", NIXL_METHOD, apis=list(APIS), skipped=self.skipped)


def nixl_lines(run: NixlRun, rows: tuple[KVMoveRow, ...], trip: RoundTrip,
               setting: str) -> list[str]:
    """The comparison: per kvmove row with a NIXL row, both GB/s and kvmove / NIXL; then
    the one-block round trip of each. ``setting``: the transports and error mode both ran
    with, as the header says them."""
    head = [*KVMOVE_HEAD, "NIXL descs", "NIXL GB/s", "strided GB/s", "kvmove / best NIXL",
            "NIXL verified"]
    cells = []
    for row in rows:
        ways, nixl = run.rows_for(row), run.row_for(row)
        if nixl is not None:
            speeds = [f"{ways[api].gbytes_per_s:.2f}" if api in ways else "-" for api in APIS]
            cells.append([*kvmove_cells(row), f"{nixl.num_descs:,}", *speeds,
                          f"{run.ratio(row):.2f}",
                          "yes" if all(w.verified for w in ways.values()) else "NO"])
    preps = {api: min((r.prep_seconds for r in run.rows if r.api == api), default=None)
             for api in APIS}
    prep_line = ("NIXL's descriptor lists, prepared once per block size (what its first "
                 "request waits for): " + ", ".join(
                     f"{api} {1e3 * seconds:.1f} ms" for api, seconds in preps.items()
                     if seconds is not None)
                 + (f" ({run.skipped})" if run.skipped else ""))
    header = (f"against {run.version} in this run ({setting}, NIXL's UCX backend, no NIXL "
              f"progress thread): {NIXL_METHOD}; best of the same iterations, every byte "
              "verified:")
    return comparison_lines(header, head, cells, prep_line, trip_line(
        run, trip, "NIXL", "one prepared request, posted again each time"))


# The columns of kvmove's row that open every comparison's table (``kvmove_cells``).
KVMOVE_HEAD = ("op", "placement", "block", "bytes", "kvmove ops", "kvmove GB/s")


def kvmove_cells(row: KVMoveRow) -> list[str]:
    """kvmove's ``row`` under ``KVMOVE_HEAD``."""
    return [row.op, row.placement, str(row.block_size), f"{row.nbytes:,}", f"{row.num_ops:,}",
            f"{row.gbytes_per_s:.2f}"]


def trip_line(run: LibraryRun, trip: RoundTrip, name: str, how: str) -> str:
    """kvmove's one-block round trip ``trip`` beside the library's (``name``, which does it
    as ``how`` says)."""
    other = run.round_trip
    return (f"one-block write + notification, one way ({trip.nbytes:,} B, median of "
            f"{other.iterations}): kvmove {trip.one_way_us:.1f} us, {name} "
            f"{other.one_way_us:.1f} us ({how}): kvmove / {name} time "
            f"{run.round_trip_ratio(trip):.2f} (below 1: kvmove faster)")


def comparison_lines(header: str, head: list[str], cells: list[list[str]],
                     *notes: str) -> list[str]:
    """``header`` wrapped, the table (its first two columns and last left-aligned), then
    each of ``notes`` wrapped: 100 columns."""
    return [*textwrap.wrap(header, width=100), *aligned(head, cells, left={0, 1, len(head) - 1}),
            *(line for note in notes for line in textwrap.wrap(note, width=100))]
