"""One client request as the router holds it (``Handle``): what it asked for, where it went,
and the queue its tokens and its end arrive in."""

from __future__ import annotations

import asyncio
import time

from kvmove.engine.request import SamplingParams

__all__ = ["Handle"]


class Handle:
    """One client request: its tokens arrive in ``events`` as ("token", id) and one
    ("end", reason, text, error)."""

    def __init__(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.rid, self.prompt, self.params = rid, prompt, params
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.num_tokens = 0
        self.workers: list[str] = []
        self.done = False
        self.ttft: float | None = None
        self.uncached = 0  # prompt tokens its prefill worker computes, as routing estimated
        self.hashes: list[int] = []  # its prompt's prefix blocks (routing.py)
