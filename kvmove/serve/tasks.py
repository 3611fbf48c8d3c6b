"""The router's asyncio tasks (``Tasks``): its loops, each named and meant to run until the
router stops (one that ended anyway is what ``/health`` reports: a router that no longer hears
its workers serves nobody), and the work it spawns (a request's placement, a worker's drain),
each forgotten once done. ``cancel`` ends them all when the router stops."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Tasks"]


class Tasks:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix  # of the loops' task names
        self._loops: dict[str, asyncio.Task] = {}
        self._spawned: set[asyncio.Task] = set()  # running ones only: each drops itself

    def loop(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        self._loops[name] = asyncio.create_task(work, name=f"{self.prefix}-{name}")

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    def ended(self) -> str:
        """The loops that ended, and why ("" while all run)."""
        return ", ".join(f"{name} loop ({_why(task)})" for name, task in self._loops.items()
                         if task.done())

    def cancel_loop(self, name: str) -> None:
        """Ends the loop ``name`` (if started)."""
        task = self._loops.get(name)
        if task is not None:
            task.cancel()

    def cancel(self) -> None:
        for task in [*self._spawned, *self._loops.values()]:
            task.cancel()


def _why(task: asyncio.Task) -> str:
    if task.cancelled():
        return "cancelled"
    error = task.exception()
    return f"{type(error).__name__}: {error}" if error is not None else "returned"
