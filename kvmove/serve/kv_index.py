"""KV-aware routing: which worker holds which blocks (``KVIndex``), and where a request goes
(``choose``).

Workers announce the block hashes their prefix cache and KVStore gain and lose (``kv``
events, ``kv_events.py``); the index mirrors them, and forgets a worker when its process dies
or a new one registers under its name (its cache starts empty). The router hashes a prompt as
the workers' scheduler does (``kvmove.block_pool.prefix_hashes``, with the
deployment's seed) and asks the index how long a prefix each worker holds.

How a worker is chosen (``cost``, in prompt tokens, the lowest wins):

    cost(w) = uncached(w) + pending(w) + LOAD_TOKENS * load(w)

* ``uncached(w)``: the prompt tokens ``w`` would prefill: the prompt less its cached prefix,
  less ``STORE_SAVING`` of the blocks after it that its store holds (a load from the store
  costs less than a prefill, not nothing);
* ``pending(w)``: prompt tokens of the requests already placed on ``w`` that it has not
  prefilled yet (each counted as uncached when placed): the prefill queue a new request
  waits behind;
* ``load(w)``: its requests in flight, each worth ``LOAD_TOKENS`` of prefill (a running
  request slows every step of the batch it is in): so a worker holding every prefix does not
  take every request.

Ties go to the fewer requests, then the fewer waiting, then the first worker. This is
Dynamo's KV router's trade (overlap against active blocks) in one unit, TTFT's: the work a
request waits for plus its own. With no prefix held anywhere it spreads requests by their
prefill work, as least-loaded does by their count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the engine's messages import torch; the proxy uses this without it
    from kvmove.serve.messages import KVEvents

__all__ = ["LOAD_TOKENS", "REASONS", "STORE_SAVING", "Candidate", "Decision", "KVIndex",
           "choose", "cost", "least_loaded"]

LOAD_TOKENS = 64     # prefill tokens one request in flight is worth
STORE_SAVING = 0.5   # the share of a block's prefill a load from the store saves
REASONS = ("kv_hit", "load", "no_match", "least_loaded")
MEDIA = ("cache", "store")


class KVIndex:
    """Block hash → the workers holding it, per medium ("cache", "store")."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], set[int]] = {}  # (worker, medium) -> hashes

    def apply(self, worker: str, event: KVEvents) -> None:
        self.add(worker, event.medium, event.stored)
        self.discard(worker, event.medium, event.removed)

    def add(self, worker: str, medium: str, hashes: Iterable[int]) -> None:
        self._held.setdefault((worker, medium), set()).update(hashes)

    def discard(self, worker: str, medium: str, hashes: Iterable[int]) -> None:
        self._held.get((worker, medium), set()).difference_update(hashes)

    def clear(self, worker: str, medium: str) -> None:
        self._held.pop((worker, medium), None)

    def remove_worker(self, worker: str) -> None:
        """Forgets everything ``worker`` announced (its process died, or a new one starts)."""
        for medium in MEDIA:
            self._held.pop((worker, medium), None)

    def num_blocks(self, worker: str, medium: str = "cache") -> int:
        return len(self._held.get((worker, medium), ()))

    def match(self, worker: str, hashes: Sequence[int],
              coming: Set[int] = frozenset()) -> tuple[int, int]:
        """(blocks, of them in the store only) of the longest prefix of ``hashes`` that
        ``worker`` holds: its prefix cache first, then its store (as its scheduler loads).
        ``coming``: the blocks of the requests placed on it and not yet announced, counted
        as cached: a prefix's repeats that arrive while its first request is still queued
        follow it (its KV events only tell what was computed)."""
        cache = self._held.get((worker, "cache"), set())
        store = self._held.get((worker, "store"), set())
        n = 0
        while n < len(hashes) and (hashes[n] in cache or hashes[n] in coming):
            n += 1
        stored = 0
        while n + stored < len(hashes) and hashes[n + stored] in store:
            stored += 1
        return n + stored, stored


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker a request could go to, as the router sees it now."""

    name: str
    cached_tokens: int = 0   # the prompt's prefix in its cache
    stored_tokens: int = 0   # the prompt's blocks after that in its store
    pending_tokens: int = 0  # uncached prompt tokens placed on it, not yet prefilled
    load: int = 0            # its requests in flight
    waiting: int = 0         # its scheduler's queue (last stats)

    @property
    def matched_tokens(self) -> int:
        return self.cached_tokens + self.stored_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    reason: str          # one of REASONS
    matched_tokens: int  # the chosen worker's cached (or stored) prefix
    uncached_tokens: int  # what it will prefill (its pending work once placed)


def cost(c: Candidate, prompt_tokens: int) -> float:
    """The module docstring's cost, in prompt tokens."""
    return uncached(c, prompt_tokens) + c.pending_tokens + LOAD_TOKENS * c.load


def uncached(c: Candidate, prompt_tokens: int) -> int:
    return max(0, round(prompt_tokens - c.cached_tokens - STORE_SAVING * c.stored_tokens))


def choose(candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
    """The cheapest candidate (``cost``), and why: ``kv_hit`` (it holds the longest prefix
    any holds), ``load`` (another holds a longer one, but is busier by more than it saves),
    ``no_match`` (no one holds any of it)."""
    best = min(candidates, key=lambda c: (cost(c, prompt_tokens), c.load, c.waiting))
    longest = max(c.matched_tokens for c in candidates)
    reason = "no_match" if longest == 0 else (
        "kv_hit" if best.matched_tokens == longest else "load")
    return Decision(best.name, reason, best.matched_tokens, uncached(best, prompt_tokens))


def least_loaded(candidates: Sequence[Candidate], prompt_tokens: int) -> Decision:
    """The fewest requests in flight, then the fewest waiting (``--routing least-loaded``)."""
    best = min(candidates, key=lambda c: (c.load, c.waiting))
    return Decision(best.name, "least_loaded", best.matched_tokens,
                    uncached(best, prompt_tokens))
