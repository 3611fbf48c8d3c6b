"""The planner: how many prefill and decode workers (``--planner``), decided from samples of
each pool's queue and utilisation, within ``--prefill-workers`` / ``--decode-workers``
bounds.

``decide`` is the decision, a pure function: the recent samples in, at most one action per
pool out (``add`` or ``drain``, with its reason). The ``Planner`` samples the pools every
``--planner-interval`` seconds, keeps the last ``WINDOW`` samples, asks ``decide`` and carries
it out through ``Pools``, all it knows of the server (``Supervisor`` is the one there is):
``add`` starts a worker as any is started, ``drain`` stops placing requests on one, lets its
requests finish, then shuts it down. It counts each action in the counter it is given
(``kvmove_planner_decisions_total``).

How it decides, per pool (Dynamo's planner's signals: a clogged pool shows in its own queue;
the right prefill:decode ratio follows the prompt and output lengths, which is what the two
queues measure):

* below its minimum → ``add`` (``below_min``); above its maximum → ``drain`` (``above_max``);
* every one of the last ``GROW_SAMPLES`` samples over-loaded → ``add`` (``queue``): requests
  waiting per worker ≥ ``GROW_QUEUE`` (prefill: prompts not yet computed; decode: requests
  waiting for a batch slot, blocks, or their KV), or (decode) its KV blocks or batch slots
  ≥ ``GROW_UTILISATION`` used (``utilisation``);
* every one of the last ``SHRINK_SAMPLES`` samples idle → ``drain`` (``idle``): nothing
  waiting, and what runs would fit on one worker fewer at ≤ ``SHRINK_UTILISATION``;
* hysteresis: growing needs a sustained queue, shrinking a longer sustained idleness, the two
  thresholds are far apart (a pool shrunk at ``SHRINK_UTILISATION`` is far from growing
  again), and after an action a pool waits ``COOLDOWN_SAMPLES`` samples, so it does not flap.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvmove.engine.role import Role
from kvmove.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = ["ACTIONS", "Action", "Bounds", "Planner", "PoolSample", "Pools", "REASONS", "decide",
           "parse_bounds"]

logger = logging.getLogger(__name__)

ACTIONS = ("add", "drain")
REASONS = ("below_min", "above_max", "queue", "utilisation", "idle")
GROW_QUEUE = 2.0           # requests waiting per worker, sustained: the pool is clogged
GROW_UTILISATION = 0.9     # decode: KV blocks or batch slots used, sustained
SHRINK_UTILISATION = 0.3   # what runs, on one worker fewer, would use at most this
GROW_SAMPLES = 3
SHRINK_SAMPLES = 10
COOLDOWN_SAMPLES = 5
WINDOW = max(GROW_SAMPLES, SHRINK_SAMPLES)


@dataclass(frozen=True, slots=True)
class Bounds:
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ConfigError(f"worker bounds must be 1 <= MIN <= MAX, got "
                              f"{self.low}:{self.high}")


def parse_bounds(text: str) -> Bounds:
    """``"MIN:MAX"`` (or ``"N"``: exactly N)."""
    low, _, high = text.partition(":")
    try:
        values = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"worker bounds must be MIN:MAX, got {text!r}") from None
    return Bounds(*values)  # ConfigError naming the bounds unless 1 <= MIN <= MAX


@dataclass(frozen=True, slots=True)
class PoolSample:
    """One pool at one instant: its workers taking requests (not draining), what waits and
    runs on them, and (decode) the larger of its used shares of KV blocks and batch slots."""

    workers: int
    waiting: int
    running: int
    utilisation: float = 0.0
    capacity: int = 64        # batch slots per worker (--max-num-seqs)


@dataclass(frozen=True, slots=True)
class Action:
    pool: Role
    action: str   # one of ACTIONS
    reason: str   # one of REASONS


def decide(samples: Sequence[Mapping[Role, PoolSample]], bounds: Mapping[Role, Bounds],
           since_action: Mapping[Role, int]) -> list[Action]:
    """At most one action per pool in ``bounds`` from ``samples`` (oldest first, one mapping
    pool → sample per interval); ``since_action``: samples since the pool's last action
    (absent: none yet)."""
    if not samples:
        return []
    actions = []
    for pool, bound in bounds.items():
        action = _decide_pool(pool, [s[pool] for s in samples if pool in s], bound,
                              since_action.get(pool, COOLDOWN_SAMPLES))
        if action is not None:
            actions.append(action)
    return actions


def _decide_pool(pool: Role, history: list[PoolSample], bound: Bounds,
                 since: int) -> Action | None:
    if not history:
        return None
    now = history[-1]
    if now.workers < bound.low:
        return Action(pool, "add", "below_min")
    if now.workers > bound.high:
        return Action(pool, "drain", "above_max")
    if since < COOLDOWN_SAMPLES:
        return None
    grow = _sustained(history, GROW_SAMPLES, lambda s: _clogged(s, pool))
    if grow is not None and now.workers < bound.high:
        return Action(pool, "add", grow)
    idle = _sustained(history, SHRINK_SAMPLES, _idle)
    if idle is not None and now.workers > bound.low:
        return Action(pool, "drain", idle)
    return None


def _sustained(history: list[PoolSample], n: int,
               test: Callable[[PoolSample], str | None]) -> str | None:
    """The reason ``test`` gives for each of the last ``n`` samples (the latest's), or None
    when fewer than ``n`` samples or one of them gives none."""
    if len(history) < n:
        return None
    reasons = [test(s) for s in history[-n:]]
    return reasons[-1] if all(reasons) else None


def _clogged(s: PoolSample, pool: Role) -> str | None:
    if s.workers and s.waiting / s.workers >= GROW_QUEUE:
        return "queue"
    if pool == Role.DECODE and s.utilisation >= GROW_UTILISATION:
        return "utilisation"
    return None


def _idle(s: PoolSample) -> str | None:
    if s.waiting or s.workers < 2:
        return None
    fewer = (s.workers - 1) * s.capacity
    share = max(s.running / fewer, s.utilisation * s.workers / (s.workers - 1))
    return "idle" if share <= SHRINK_UTILISATION else None


class Pools(Protocol):
    """What the planner needs of the server: a pool's sample now, and a worker more or one
    fewer in a pool. (What they return, the planner does not use.)"""

    def sample(self, pool: Role) -> PoolSample: ...

    def add(self, pool: Role) -> object: ...

    def drain(self, pool: Role) -> object: ...


class Planner:
    """Samples ``pools`` every ``interval`` seconds and carries out ``decide``, counting each
    action in ``decisions`` (labels ``pool``, ``action``, ``reason``)."""

    def __init__(self, pools: Pools, bounds: Mapping[Role, Bounds], interval: float,
                 decisions: Counter) -> None:
        self.pools, self.bounds, self.interval = pools, dict(bounds), interval
        self.decisions = decisions
        self.samples: deque[dict[Role, PoolSample]] = deque(maxlen=WINDOW)
        self.since: dict[Role, int] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.step()

    def step(self) -> list[Action]:
        self.samples.append({pool: self.pools.sample(pool) for pool in self.bounds})
        for pool in self.since:
            self.since[pool] += 1
        actions = decide(list(self.samples), self.bounds, self.since)
        for action in actions:
            self.act(action, self.samples[-1][action.pool])
        if actions:
            self.samples.clear()  # the next decision sees the pools as they are now
        return actions

    def act(self, action: Action, sample: PoolSample) -> None:
        logger.info("planner: %s a %s worker (%s: %d workers, %d waiting, %d running, "
                    "utilisation %.2f)", action.action, action.pool, action.reason,
                    sample.workers, sample.waiting, sample.running, sample.utilisation)
        self.decisions.labels(pool=action.pool, action=action.action,
                              reason=action.reason).inc()
        if action.action == "add":
            self.pools.add(action.pool)
        else:
            self.pools.drain(action.pool)
        self.since[action.pool] = 0
