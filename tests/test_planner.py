"""The planner's decision (issue 19): ``planner.decide`` is pure (samples in, actions out), so
traces of pool samples check it deterministically: long prompts grow the prefill pool, long
outputs the decode pool, the bounds hold, and hysteresis keeps it from flapping."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvmove.engine.role import Role
from kvmove.errors import ConfigError
from kvmove.serve.config import ServeConfig
from kvmove.serve.planner import (
    COOLDOWN_SAMPLES,
    GROW_SAMPLES,
    SHRINK_SAMPLES,
    Action,
    Bounds,
    Planner,
    PoolSample,
    decide,
    parse_bounds,
)

BOUNDS = {"prefill": Bounds(1, 3), "decode": Bounds(1, 3)}


def _trace(prefill: list[PoolSample], decode: list[PoolSample]) -> list[dict[str, PoolSample]]:
    return [{"prefill": p, "decode": d} for p, d in zip(prefill, decode)]


def _replay(trace: list[dict[str, PoolSample]], bounds=BOUNDS) -> list[tuple[int, Action]]:
    """Runs ``decide`` over ``trace`` as the Planner does (a window, cooldowns, the window
    cleared after an action), with each action applied to the pool's worker count from then
    on; (sample index, action) for every action."""
    workers = {pool: trace[0][pool].workers for pool in bounds}
    since: dict[str, int] = {}
    window: list[dict[str, PoolSample]] = []
    actions = []
    for i, sample in enumerate(trace):
        sample = {pool: _with_workers(s, workers[pool]) for pool, s in sample.items()}
        window = (window + [sample])[-SHRINK_SAMPLES:]
        since = {pool: n + 1 for pool, n in since.items()}
        for action in decide(window, bounds, since):
            actions.append((i, action))
            workers[action.pool] += 1 if action.action == "add" else -1
            since[action.pool] = 0
            window = []
    return actions


def _with_workers(s: PoolSample, workers: int) -> PoolSample:
    """The same load, spread over ``workers``."""
    return PoolSample(workers, s.waiting, s.running, s.utilisation * s.workers / workers,
                      s.capacity)


def test_long_prompts_grow_the_prefill_pool_only() -> None:
    """Prompts pile up in the prefill queue; the decode pool runs few short answers."""
    prefill = [PoolSample(1, waiting=6, running=1)] * 12
    decode = [PoolSample(1, waiting=0, running=8, utilisation=0.2)] * 12
    actions = _replay(_trace(prefill, decode))
    assert [a for _, a in actions] == [Action("prefill", "add", "queue")] * 2
    assert [i for i, _ in actions] == [GROW_SAMPLES - 1,
                                       GROW_SAMPLES - 1 + max(GROW_SAMPLES, COOLDOWN_SAMPLES)]


def test_long_outputs_grow_the_decode_pool_only() -> None:
    """Long generations fill the decode workers' KV blocks; prefill keeps up."""
    prefill = [PoolSample(1, waiting=0, running=1)] * 12
    decode = [PoolSample(1, waiting=1, running=40, utilisation=0.95)] * 12
    actions = [a for _, a in _replay(_trace(prefill, decode))]
    assert actions and set(actions) == {Action("decode", "add", "utilisation")}


def test_growth_stops_at_the_upper_bound() -> None:
    prefill = [PoolSample(1, waiting=50, running=1)] * 60
    decode = [PoolSample(1, waiting=50, running=64, utilisation=1.0)] * 60
    bounds = {"prefill": Bounds(1, 2), "decode": Bounds(1, 4)}
    actions = [a for _, a in _replay(_trace(prefill, decode), bounds)]
    assert actions.count(Action("prefill", "add", "queue")) == 1
    assert sum(a.pool == "decode" for a in actions) == 3
    assert all(a.action == "add" for a in actions)


def test_out_of_bounds_pools_are_brought_back_at_once() -> None:
    samples = [{"prefill": PoolSample(4, 0, 0), "decode": PoolSample(0, 0, 0)}]
    assert decide(samples, BOUNDS, {"prefill": 0, "decode": 0}) == [
        Action("prefill", "drain", "above_max"), Action("decode", "add", "below_min")]


def test_an_idle_pool_shrinks_only_after_a_sustained_idleness_and_not_below_min() -> None:
    prefill = [PoolSample(3, waiting=0, running=0)] * 40
    decode = [PoolSample(2, waiting=0, running=1, utilisation=0.1)] * 40
    actions = _replay(_trace(prefill, decode), {"prefill": Bounds(2, 3),
                                                "decode": Bounds(1, 3)})
    assert actions[0][0] == SHRINK_SAMPLES - 1
    assert sorted(a.pool for _, a in actions) == ["decode", "prefill"]
    assert all(a.action == "drain" and a.reason == "idle" for _, a in actions)


def test_a_load_that_flickers_does_not_flap() -> None:
    """A queue every other sample is no sustained queue; an idle sample every third is no
    sustained idleness: nothing happens."""
    prefill = [PoolSample(2, waiting=8 if i % 2 else 0, running=1) for i in range(60)]
    decode = [PoolSample(2, waiting=0, running=100 if i % 3 == 0 else 1,
                         utilisation=0.05) for i in range(60)]
    assert _replay(_trace(prefill, decode)) == []


def test_after_growing_a_pool_it_does_not_shrink_at_the_next_lull() -> None:
    """A burst grows the pool; a lull of fewer than SHRINK_SAMPLES samples after it keeps it."""
    busy = [PoolSample(1, waiting=6, running=1)] * GROW_SAMPLES
    lull = [PoolSample(1, waiting=0, running=0)] * (SHRINK_SAMPLES - 1)
    decode = [PoolSample(1, 0, 0)] * len(busy + lull)
    actions = _replay(_trace(busy + lull, decode), {"prefill": Bounds(1, 3),
                                                    "decode": Bounds(1, 1)})
    assert [a for _, a in actions] == [Action("prefill", "add", "queue")]


def test_bounds_parse_and_validate() -> None:
    assert parse_bounds("1:4") == Bounds(1, 4) and parse_bounds("2") == Bounds(2, 2)
    for text in ("0:2", "3:2", "a:b", ""):
        with pytest.raises(ConfigError):
            parse_bounds(text)
    assert ServeConfig(planner=True, prefill=2).bounds() == {"prefill": Bounds(1, 4),
                                                             "decode": Bounds(1, 2)}
    with pytest.raises(ConfigError, match="needs mode 'disagg'"):
        ServeConfig(mode="colocated", planner=True)


class _Pools:
    """A ``Pools`` that records what the planner asks of it."""

    def __init__(self, samples: dict[Role, PoolSample]) -> None:
        self.samples, self.calls = samples, []

    def sample(self, pool: Role) -> PoolSample:
        return self.samples[pool]

    def add(self, pool: Role) -> None:
        self.calls.append(("add", pool))

    def drain(self, pool: Role) -> None:
        self.calls.append(("drain", pool))


def test_the_planner_acts_through_its_pools_and_counts_each_action() -> None:
    """The Planner needs nothing of the server but ``Pools`` and a counter: a step samples
    every bounded pool, and each action ``decide`` gives is carried out and counted."""
    registry = CollectorRegistry()
    decisions = Counter("decisions", "", ["pool", "action", "reason"], registry=registry)
    pools = _Pools({Role.PREFILL: PoolSample(0, 0, 0), Role.DECODE: PoolSample(4, 0, 0)})
    planner = Planner(pools, BOUNDS, 1.0, decisions)
    assert planner.step() == [Action("prefill", "add", "below_min"),
                              Action("decode", "drain", "above_max")]
    assert pools.calls == [("add", "prefill"), ("drain", "decode")]
    for pool, action, reason in (("prefill", "add", "below_min"),
                                 ("decode", "drain", "above_max")):
        labels = {"pool": pool, "action": action, "reason": reason}
        assert registry.get_sample_value("decisions_total", labels) == 1.0
    pools.samples = {Role.PREFILL: PoolSample(1, 0, 0), Role.DECODE: PoolSample(3, 0, 0)}
    assert planner.step() == [] and len(pools.calls) == 2  # within bounds, cooling down
