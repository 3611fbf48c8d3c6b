"""``kvmove-bench transfer --against mooncake``'s results: Mooncake's rows and round trip,
measured in the same run as kvmove's on the same workload, as plain data (``to_dict``, in
``--json``) and as the text lines that put kvmove's figure, Mooncake's and kvmove / Mooncake
side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmove.bench.against_report import (
    KVMOVE_HEAD,
    KVMoveRow,
    LibraryRow,
    LibraryRun,
    comparison_lines,
    kvmove_cells,
    trip_line,
)
from kvmove.bench.report import RoundTrip

__all__ = ["MOONCAKE_METHOD", "MooncakeRow", "MooncakeRun", "mooncake_lines"]

# What Mooncake is asked to do, for the text and the JSON (mooncake_side.py says why).
MOONCAKE_METHOD = (
    "Mooncake's transfer engine over its tcp protocol (P2PHANDSHAKE, no metadata server), the "
    "same cache memory registered once; per transfer one (local, remote, bytes) range per "
    "(layer, block), ranges contiguous on both sides merged as kvmove coalesces runs, and one "
    "batch call for the whole transfer (batch_transfer_sync with a TransferNotify for WRITE, "
    "batch_transfer_sync_read for READ), building the ranges and the call timed")


@dataclass(frozen=True, slots=True)
class MooncakeRow(LibraryRow):
    """Mooncake's best timed iteration of one kvmove row's workload: the same op, placement,
    block size, block ids and bytes. Seconds run from building the ranges until the batch
    call returned; ``make_seconds`` is building (and merging) the ranges alone;
    ``num_ranges`` is how many the batch carried."""

    op: str
    placement: str
    block_size: int
    nbytes: int
    num_blocks: int
    num_ranges: int
    make_seconds: float
    total_seconds: float
    iter_seconds: tuple[float, ...]
    warmup_seconds: float
    mismatched_blocks: int


@dataclass(frozen=True, slots=True)
class MooncakeRun(LibraryRun):
    """Everything Mooncake did in one run: which Mooncake (``version``: distribution and
    version), its rows (native-cache rows of every block size and placement), its one-block
    write + notification round trip, and the Mooncake settings it ran with (``settings``:
    environment variable -> value)."""

    version: str
    rows: tuple[MooncakeRow, ...]
    round_trip: RoundTrip
    settings: dict[str, str] = field(default_factory=dict)

    def row_for(self, row: KVMoveRow) -> MooncakeRow | None:
        """Mooncake's row of kvmove's ``row``; none for a wrapped cache's row: Mooncake
        moves the native cache only."""
        if row.cache != "native":
            return None
        return next((r for r in self.rows if r.key == (row.op, row.placement, row.block_size)),
                    None)

    def to_dict(self, trip: RoundTrip) -> dict[str, Any]:
        return self._to_dict(trip, "mooncake", MOONCAKE_METHOD, settings=dict(self.settings))


def mooncake_lines(run: MooncakeRun, rows: tuple[KVMoveRow, ...], trip: RoundTrip,
                   setting: str) -> list[str]:
    """The comparison: per kvmove row with a Mooncake row, both GB/s and kvmove / Mooncake;
    then the one-block round trip of each. ``setting``: kvmove's transports and error mode,
    as the header says them."""
    head = [*KVMOVE_HEAD, "Mooncake ranges", "Mooncake GB/s", "kvmove / Mooncake",
            "Mooncake verified"]
    cells = []
    for row in rows:
        mooncake = run.row_for(row)
        if mooncake is not None:
            cells.append([*kvmove_cells(row), f"{mooncake.num_ranges:,}",
                          f"{mooncake.gbytes_per_s:.2f}",
                          f"{run.ratio(row):.2f}", "yes" if mooncake.verified else "NO"])
    settings = ", ".join(f"{name}={value}" for name, value in run.settings.items())
    header = (f"against {run.version} in this run (kvmove: {setting}; Mooncake: {settings}): "
              f"{MOONCAKE_METHOD}; best of the same iterations, every byte verified:")
    return comparison_lines(header, head, cells, trip_line(
        run, trip, "Mooncake", "batch_transfer_sync of one range with a TransferNotify, the "
        "receiver polling get_notifies"))
