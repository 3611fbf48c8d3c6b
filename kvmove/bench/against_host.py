"""What a process of ``kvmove-bench transfer --against`` hosts, whichever the library: one
side at a time (``SideHost``), the library's version (``dist_version``), and the check of a
notification's payload (``expect_notification``). Kept apart from
the driver (``against_common``) so that a library's process imports only what it runs.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from kvmove.bench.report import BenchError

__all__ = ["SideHost", "dist_version", "expect_notification"]


def dist_version(dist: str) -> str:
    """``nixl-cu13 1.5.1``: ``dist`` and its installed version (``dist`` alone if it has
    none)."""
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return dist


def expect_notification(library: str, tag: object, payload: object) -> None:
    """Raises ``BenchError`` unless the notification ``payload`` a side of ``library``
    ("NIXL") got is the ``tag`` it waited for."""
    if payload != tag:
        raise BenchError(f"expected {library} notification {tag!r}, got {payload!r}")


class SideHost:
    """What a library's process hosts between ``setup``s: one side at a time, whose verbs
    (``verbs``) run on command; a subclass imports the library and builds the side."""

    verbs: tuple[str, ...] = ()
    side_kind = "side"  # how "no setup yet" names it

    def __init__(self) -> None:
        self.side: Any = None

    def _replace(self, make: Callable[[], Any]) -> None:
        """Closes the last side, then makes the next."""
        self.close()
        self.side = make()

    def __getattr__(self, verb: str) -> Any:
        if verb not in type(self).verbs:
            raise AttributeError(f"{type(self).__name__} has no command {verb!r}")
        if self.side is None:
            raise BenchError(f"no setup yet: {verb!r} needs a {self.side_kind}")
        return getattr(self.side, verb)

    def close(self) -> None:
        side, self.side = self.side, None
        if side is not None:
            side.close()
