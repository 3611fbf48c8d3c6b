"""Runs of a peer told apart by identity, not by clock (csrc/transport/peer_runs.h, issue 27).

A peer's run is its incarnation. Metadata of an incarnation not seen under the name is a new
run and replaces the known one, whatever its ``started_ns`` (wall clock) says; metadata of a run
that another replaced is a replay, refused. Two real agents in this process over tcp, and for
a restart a third under the second's name; where a test needs metadata no real agent would
send (another start time, another incarnation), it is a real agent's, rebuilt field by field
and signed with the deployment key.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvmove
from kvmove.errors import PeerError

from helpers.checks import names
from helpers.kv import make_cache, raw_view
from helpers.wire import build, parse

LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
NUM_BLOCKS = 12
WAIT = 10.0
TCP = {"transports": "tcp", "error_mode": "peer"}
MAX_RETIRED_RUNS = 64  # PeerRuns::kMaxRetiredRuns


def agent(name: str) -> kvmove.Agent:
    return kvmove.Agent(name, make_cache(LAYOUT, NUM_BLOCKS), **TCP)


def rebuilt(source: kvmove.Agent, **changes: object) -> bytes:
    """``source``'s metadata with ``changes`` to its fields, re-checksummed and signed with
    the deployment key (every agent here holds this user's host key)."""
    fields = parse(source.key.verify(source.metadata()))
    return source.key.sign(build({**fields, **changes}))


class Pair:
    """Agents ``a`` (random bytes) and ``b`` (zeros), peers of each other; ``b_ref`` is what
    b's cache must still hold once a newer run of b replaced it."""

    def __init__(self) -> None:
        self.a, self.b = agent("a"), agent("b")
        raw_view(self.a.cache)[...] = np.random.default_rng(3).integers(
            0, 256, size=raw_view(self.a.cache).shape, dtype=np.uint8)
        self.a.add_peer(self.b.metadata())
        self.b.add_peer(self.a.metadata())
        self.b_ref = raw_view(self.b.cache).copy()

    def assert_reaches(self, target: kvmove.Agent) -> None:
        """a's write to "b" lands in ``target``'s cache, with its notification."""
        self.a.write("b", [2], [7], notify=b"to b").wait(WAIT)
        assert target.wait_notification(WAIT) == ("a", b"to b")
        np.testing.assert_array_equal(raw_view(target.cache)[:, 7], raw_view(self.a.cache)[:, 2])

    def assert_old_b_untouched(self) -> None:
        np.testing.assert_array_equal(raw_view(self.b.cache), self.b_ref)
        assert self.b.notifications() == []

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def again(pair: Pair) -> Iterator[kvmove.Agent]:
    """A new run of b: another agent under b's name (another incarnation), not yet a peer."""
    with agent("b") as new_run:
        assert new_run.incarnation != pair.b.incarnation
        yield new_run


def restart(pair: Pair, new_run: kvmove.Agent, metadata: bytes | None = None) -> None:
    """a and the new run of b exchange metadata, as they would on a reconnect."""
    assert pair.a.add_peer(metadata or new_run.metadata()) == "b"
    new_run.add_peer(pair.a.metadata())
    assert pair.a.peers == ["b"]


def test_a_new_run_whose_clock_says_it_started_earlier_replaces_the_old_run(pair, again):
    """The deployment of issue 27: the old run's host clock was 5 s ahead (or the clock
    stepped back), and a new run started within those 5 s was refused on every connect
    ("a run that started before the one agent 'decode-0' knows"). Its incarnation is one a
    has not seen, so it is a new run: a takes it, writes reach it, the old run is left
    alone."""
    known = parse(pair.b.key.verify(pair.b.metadata()))["started_ns"]
    behind = rebuilt(again, started_ns=known - 5 * 10**9)
    restart(pair, again, behind)
    pair.assert_reaches(again)
    pair.assert_old_b_untouched()


def test_the_replaced_runs_metadata_replayed_is_refused(pair, again):
    """The old run's metadata (a stale copy, or the old process still announcing itself)
    after the new run replaced it: refused, naming the retired incarnation; the new run stays
    the peer and keeps working. Its clock says it started first, which no longer matters:
    the next test's replay claims a later start."""
    restart(pair, again)
    with pytest.raises(PeerError, match="is a replay") as excinfo:
        pair.a.add_peer(pair.b.metadata())
    names(excinfo, "'b'", pair.b.incarnation, again.incarnation, "'a'", "retired")
    assert pair.a.peers == ["b"]
    pair.assert_reaches(again)
    pair.assert_old_b_untouched()


def test_a_replay_claiming_a_later_start_is_refused_too(pair, again):
    """A replay cannot pass for a new run by its clock: the old run's metadata with a start
    an hour after the new run's is still the retired incarnation."""
    restart(pair, again)
    later = parse(again.key.verify(again.metadata()))["started_ns"] + 3600 * 10**9
    with pytest.raises(PeerError, match="is a replay") as excinfo:
        pair.a.add_peer(rebuilt(pair.b, started_ns=later))
    names(excinfo, "'b'", pair.b.incarnation)
    pair.assert_reaches(again)


def test_the_old_run_reconnecting_is_refused_by_the_listener(pair, again):
    """The way a replay arrives in a deployment: the old process connects again (the
    listener's add_peer). It is told why; the new run stays the peer."""
    restart(pair, again)
    address = pair.a.listen()
    with pytest.raises(PeerError, match="is a replay") as excinfo:
        pair.b.connect(*address, timeout=WAIT)
    names(excinfo, pair.b.incarnation)
    assert pair.a.peers == ["b"]
    pair.assert_reaches(again)


def test_a_removed_run_rejoins_and_is_retired_only_by_the_next_run(pair, again):
    """remove_peer retires nothing: the same run may be added again (a user who removed a
    peer and changed their mind). The next run of the name retires it, even when it was
    removed before that run came, and a later removal does not forget that."""
    pair.a.remove_peer("b")
    assert pair.a.add_peer(pair.b.metadata()) == "b"
    pair.a.remove_peer("b")
    assert pair.a.add_peer(again.metadata()) == "b"
    pair.a.remove_peer("b")
    with pytest.raises(PeerError, match="is a replay") as excinfo:
        pair.a.add_peer(pair.b.metadata())
    names(excinfo, pair.b.incarnation, again.incarnation)
    assert pair.a.peers == []
    assert pair.a.add_peer(again.metadata()) == "b"
    # No notification: the new run has not added a, and would drop one as from no peer.
    pair.a.write("b", [4], [1]).wait(WAIT)
    np.testing.assert_array_equal(raw_view(again.cache)[:, 1], raw_view(pair.a.cache)[:, 4])
    pair.assert_old_b_untouched()


def test_the_known_runs_incarnation_at_another_address_is_refused(pair, again):
    """One run has one worker address: metadata naming the known incarnation somewhere else
    is no run of that peer (the clock used to refuse it: same start, not later)."""
    with pytest.raises(PeerError, match="another worker address") as excinfo:
        pair.a.add_peer(rebuilt(again, incarnation=pair.b.incarnation))
    names(excinfo, "'b'", pair.b.incarnation, "'a'")
    assert pair.a.peers == ["b"]
    pair.assert_reaches(pair.b)


def test_a_name_remembers_its_last_64_retired_runs(pair, again):
    """The bound (peer_runs.h): per name, the last 64 retired runs. After 65 more runs of b
    (one real agent, announced under 65 incarnations), b's first run is forgotten and would
    be taken for a new run; the runs after it are still refused."""
    taken = {pair.b.incarnation, again.incarnation}
    runs = [n for n in range(1, MAX_RETIRED_RUNS + 4) if n not in taken][:MAX_RETIRED_RUNS + 1]
    for incarnation in runs:
        assert pair.a.add_peer(rebuilt(again, incarnation=incarnation)) == "b"
    with pytest.raises(PeerError, match="is a replay") as excinfo:
        pair.a.add_peer(rebuilt(again, incarnation=runs[0]))
    names(excinfo, runs[0], runs[-1])
    assert pair.a.add_peer(pair.b.metadata()) == "b"
