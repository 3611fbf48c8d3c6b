"""What every ``kvmove-bench`` report shares: the benchmarks' error, and the helpers their text
and plots are written with. Each benchmark's own text and plots live in its module."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from kvmove.errors import KVMoveError

__all__ = ["BenchError", "RoundTrip", "aligned", "human_bytes", "ms", "pyplot", "save_figure"]


class BenchError(KVMoveError):
    """The benchmark's peer process failed, died, or did not answer in time."""


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """One block of one layer written with a notification, answered the same way (kvmove's,
    or NIXL's through one prepared request).

    ``one_way_us`` is half the median round trip, as ``ucp_put_lat`` reports its ping-pong.
    """

    nbytes: int
    iterations: int
    rtt_us: float

    @classmethod
    def of(cls, nbytes: int, seconds: list[float]) -> RoundTrip:
        """From the round trips' durations in seconds."""
        return cls(nbytes, len(seconds), statistics.median(seconds) * 1e6)

    @property
    def one_way_us(self) -> float:
        return self.rtt_us / 2

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "one_way_us": self.one_way_us}


def aligned(head: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """Columns padded to their widest cell: ``left`` ones read left to right (names), the
    others line up on the right (numbers)."""
    widths = [max(len(cells[i]) for cells in [head, *rows]) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()
            for cells in [head, *rows]]


def ms(value: float) -> str:
    return f"{value:.3f}" if value < 1 else f"{value:.2f}"


def human_bytes(nbytes: int) -> str:
    """``"524.3 MB, 500.0 MiB"``: decimal and binary units side by side."""
    return f"{_scaled(nbytes, 1000, 'kMGT', 'B')}, {_scaled(nbytes, 1024, 'KMGT', 'iB')}"


def _scaled(nbytes: int, base: int, prefixes: str, suffix: str) -> str:
    value, unit = float(nbytes), "B"
    for prefix in prefixes:
        if value < base:
            break
        value, unit = value / base, prefix + suffix
    return f"{value:.1f} {unit}"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: plots go to files, no display needed.
    Imported on first use: matplotlib is the ``[bench]`` extra's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    """Writes ``fig`` to ``path`` (120 dpi) and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
