"""KV-aware routing's pure parts (issue 19): the worker's KV events from a real ``BlockPool``
(``kv_events.py``), the router's index of them and the placement score (``kv_index.py``).
Deterministic: no processes, no clocks (``take`` is given its time)."""

from __future__ import annotations

import pytest

from kvmove.block_pool import BlockPool, prefix_hashes
from kvmove.errors import PeerError
from kvmove.serve.kv_events import MIN_SECONDS, KVEventSource, batches
from kvmove.serve.kv_index import LOAD_TOKENS, Candidate, KVIndex, choose, cost, least_loaded
from kvmove.serve.messages import MAX_KV_HASHES, KVEvents, encode, parse_event

BLOCK = 16


def _index(**held: list[int]) -> KVIndex:
    index = KVIndex()
    for worker, hashes in held.items():
        index.apply(worker, KVEvents(medium="cache", stored=hashes, removed=[]))
    return index


# --- the worker's events ------------------------------------------------------------------------

def test_events_announce_committed_blocks_once_and_evicted_ones_as_removed() -> None:
    pool = BlockPool(4)
    source = KVEventSource(pool)
    ids = pool.allocate(2)
    pool.commit(ids, [11, 12])
    source.stepped()
    [event] = source.take(now=1.0)
    assert (event.medium, event.stored, event.removed) == ("cache", [11, 12], [])
    source.stepped()
    assert source.take(now=2.0) == []          # nothing changed: nothing sent
    pool.free(ids)                              # cached, still held
    pool.allocate(4)                            # evicts both
    source.stepped()
    assert source.take(now=2.0 + MIN_SECONDS / 2) == []  # not due yet
    [event] = source.take(now=3.0)
    assert (event.stored, event.removed) == ([], [11, 12])


def test_events_are_bounded_in_size_and_parse() -> None:
    hashes = list(range(2**64 - MAX_KV_HASHES - 5, 2**64))
    events = batches("cache", hashes, [1])
    assert [len(e.stored) for e in events] == [MAX_KV_HASHES, 5, 0]
    assert events[-1].removed == [1]
    assert parse_event(encode(events[0])) == events[0]
    with pytest.raises(PeerError, match="stored"):
        parse_event(b'{"ev": "kv", "medium": "cache", "stored": [-1], "removed": []}')
    too_many = ",".join(["1"] * (MAX_KV_HASHES + 1)).encode()
    with pytest.raises(PeerError, match="stored"):
        parse_event(b'{"ev": "kv", "medium": "cache", "stored": [' + too_many +
                    b'], "removed": []}')


# --- the index ----------------------------------------------------------------------------------

def test_index_matches_the_longest_prefix_cache_first_then_store() -> None:
    prompt = list(range(5 * BLOCK + 3))
    h = prefix_hashes(prompt, BLOCK)
    assert len(h) == 5
    index = _index(a=h[:2], b=h[:4] + [999])
    index.apply("a", KVEvents(medium="store", stored=h[2:4], removed=[]))
    assert index.match("a", h) == (4, 2)
    assert index.match("b", h) == (4, 0)
    assert index.match("c", h) == (0, 0)
    index.apply("b", KVEvents(medium="cache", stored=[], removed=[h[1]]))
    assert index.match("b", h) == (1, 0)      # a hole ends the prefix
    assert index.match("b", h, coming={h[1]}) == (4, 0)  # the hole is placed there, coming
    index.remove_worker("a")
    assert index.match("a", h) == (0, 0) and index.num_blocks("a", "store") == 0


def test_prefix_hashes_leave_a_token_to_compute_and_follow_the_seed() -> None:
    assert prefix_hashes(list(range(BLOCK)), BLOCK) == []
    assert len(prefix_hashes(list(range(BLOCK + 1)), BLOCK)) == 1
    assert prefix_hashes(list(range(40)), BLOCK, 7) != prefix_hashes(list(range(40)), BLOCK)


# --- the score ----------------------------------------------------------------------------------

def test_the_longest_cached_prefix_wins_when_queues_are_equal() -> None:
    d = choose([Candidate("a"), Candidate("b", cached_tokens=256)], 300)
    assert (d.name, d.reason, d.matched_tokens, d.uncached_tokens) == ("b", "kv_hit", 256, 44)


def test_a_busy_holder_loses_to_an_idle_worker_once_its_queue_outweighs_the_prefix() -> None:
    holder = Candidate("b", cached_tokens=64, pending_tokens=500, load=3)
    d = choose([Candidate("a"), holder], 300)
    assert (d.name, d.reason) == ("a", "load")
    assert cost(holder, 300) == 300 - 64 + 500 + 3 * LOAD_TOKENS


def test_no_match_spreads_by_pending_prefill_then_load() -> None:
    d = choose([Candidate("a", pending_tokens=100, load=1), Candidate("b", load=1)], 50)
    assert (d.name, d.reason) == ("b", "no_match")
    d = choose([Candidate("a", load=1), Candidate("b")], 50)
    assert d.name == "b"
    assert choose([Candidate("a"), Candidate("b")], 50).name == "a"  # ties: the first


def test_a_stored_prefix_counts_for_part_of_a_cached_one() -> None:
    d = choose([Candidate("a", cached_tokens=128), Candidate("b", stored_tokens=192)], 256)
    assert d.name == "a"                      # 256 - 128 = 128  <  256 - 0.5 * 192 = 160
    d = choose([Candidate("a", cached_tokens=32), Candidate("b", stored_tokens=192)], 256)
    assert (d.name, d.reason) == ("b", "kv_hit")


def test_least_loaded_ignores_the_prefix_but_reports_what_it_landed_on() -> None:
    d = least_loaded([Candidate("a", cached_tokens=256, load=2), Candidate("b", load=1)], 300)
    assert (d.name, d.reason, d.matched_tokens) == ("b", "least_loaded", 0)
