"""Layer-wise streaming (``kvmove/stream.py``, ``csrc/stream/layer_stream.h``):
``Agent.stream_to`` / ``SaveStream`` on the prefill side, ``Agent.expect`` / ``LoadStream`` on
the decode side.

The one promise everything rests on: once ``wait_for_layer(i)`` returns (or ``layers_ready()``
says layer ``i`` is in), layer ``i``'s bytes are *exactly* in the load's blocks. The tests
check it byte for byte, the instant the load says so, and assume no ordering beyond it (a layer
not waited for may or may not be complete yet).

Two set-ups:

* two real processes (the tests here): this process holds the near agent "near", a spawned child
  (``helpers.stream_far.StreamFar``) the far one "far", connected with ``listen()``/``connect()``
  so each is the other's peer. Usually far sends and near receives; the streaming layout is
  48 layers of 16 KiB per block. The pair lives for the whole module; tests that kill a
  process spawn their own.
* two agents in this process (``helpers.stream_pair.Pair``), for rejection paths:
  ``test_stream_rejections.py``.

A stream's data is ``helpers.kv.layer_data(seed, layer)``, computed the same way in both
processes. Every request's blocks come from the caches' ``BlockPool`` and go back to it once
the stream ended, whatever the outcome; the ``link`` fixture checks after every test that both
pools are all free again.

No test may hang: every wait has a deadline, and blocking calls in threads are joined with one.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import kvmove
from kvmove import StreamState
from kvmove.bench.harness import ChildError
from kvmove.errors import (
    PeerError,
    TimeoutError,
    TransferError,
)

from helpers.checks import Background, names, within
from helpers.far import FarPeer
from helpers.kv import layer_data, make_cache, pattern, raw_view, write_layer
from helpers.stream_far import StreamFar

# Two processes: 48 layers, 4 KV heads x 64 dims, float16, 16 tokens per block:
# 16 * 4 * 64 * 2 (K, V) * 2 B = 16 KiB per block per layer; 40 blocks = 30 MiB a cache.
STREAM_LAYOUT = dict(num_layers=48, num_kv_heads=4, head_dim=64, dtype="float16",
                     block_size=16)
L = 48
BLOCK = 16 * 1024
NUM_BLOCKS = 40

# peer_timeout low, so a dead peer is declared dead by keepalive within seconds even where tcp
# does not report the reset (it usually does, in milliseconds).
TCP = {"transports": "tcp", "error_mode": "peer", "peer_timeout": 2.0}
WAIT = 10.0            # deadline of every wait that should succeed, seconds
LONG = 30.0            # deadline of waits that must be ended early by something else
PROMPT = 5.0           # "promptly": an abort or a death must end such a wait within this


def expected(seed: int, n: int, layers: range | list[int] = range(L)) -> dict[int, np.ndarray]:
    return {layer: layer_data(seed, layer, n, BLOCK) for layer in layers}


def assert_layer(got: np.ndarray, want: np.ndarray, layer: int, when: str) -> None:
    bad = int(np.count_nonzero(got != want))
    assert bad == 0, f"layer {layer}: {bad} of {want.size} bytes differ {when}"


# ---------------------------------------------------------------------------------------------
# Two processes.

class Link:
    """The near agent here and a far one in a spawned child, peers of each other through
    ``listen()`` (here) and ``connect()`` (there)."""

    def __init__(self, near_name: str, far_name: str) -> None:
        self.near_name, self.far_name = near_name, far_name
        self.far = FarPeer(far_name, STREAM_LAYOUT, NUM_BLOCKS, TCP, host=StreamFar)
        try:
            self.cache = make_cache(STREAM_LAYOUT, NUM_BLOCKS)
            self.near = kvmove.Agent(near_name, self.cache, **TCP)
            host, port = self.near.listen()
            assert self.far.call("connect", host, port) == near_name
            assert self.near.peers == [far_name]
        except BaseException:
            self.far.stop()
            raise
        self.raw = raw_view(self.cache)

    def far_ids(self, n: int) -> list[int]:
        """``n`` blocks of the far pool, zeroed."""
        ids = self.far.call("allocate", n)
        assert ids is not None, f"far pool has fewer than {n} free blocks"
        self.far.call("scrub", ids)
        return ids

    def near_ids(self, n: int) -> list[int]:
        """``n`` blocks of the near pool, zeroed."""
        ids = self.cache.pool.allocate(n)
        assert ids is not None, f"near pool has fewer than {n} free blocks"
        self.raw[:, ids] = 0
        return ids

    @contextmanager
    def request(self, n: int) -> Iterator[tuple[list[int], list[int]]]:
        """``(far_ids, near_ids)``: ``n`` zeroed blocks from each pool, freed afterwards."""
        far_ids = self.far_ids(n)
        near_ids = self.near_ids(n)
        try:
            yield far_ids, near_ids
        finally:
            if self.far.process.is_alive():
                # After a failure a stream may still run: stop it before its blocks are reused.
                self.far.call("abort_all", WAIT)
                self.far.call("free", far_ids)
            self.cache.pool.free(near_ids)

    def pools(self) -> tuple[int, int]:
        """``(far, near)`` free block counts."""
        return self.far.call("num_free"), self.cache.pool.num_free

    def close(self) -> None:
        try:
            within(15, self.near.close)
        finally:
            self.far.stop()


@pytest.fixture(scope="module")
def module_link() -> Iterator[Link]:
    link = Link("near", "far")
    try:
        yield link
    finally:
        link.close()


@pytest.fixture
def link(module_link: Link) -> Iterator[Link]:
    """The module's link; afterwards, every block of both pools is free again (test 7's
    accounting, after every outcome any test produced)."""
    yield module_link
    assert module_link.pools() == (NUM_BLOCKS, NUM_BLOCKS), \
        "blocks of a request are still allocated after the test ended"


PAYLOAD = b"\x00first-token:1234\xff"  # NUL and high bytes: the payload is bytes, not text


def test_each_layer_is_exact_once_its_wait_returns(link, record_property):
    """Test 1. The far process "computes" each layer (writes its data, sleeps 10 ms, then
    save_layer), in order, and finishes with a payload. Here, the instant each wait_for_layer(i)
    returns, layer i's bytes must be exact; later layers may or may not be complete yet (we only
    count them). wait_all returns the payload. The timings (both processes read the same
    CLOCK_MONOTONIC) show it streamed: layer 0 was in here before the sender even posted its
    last layer, and no layer was in here before the sender posted it."""
    delay = 0.01
    with link.request(8) as (src, dst):
        want = expected(seed=101, n=8)
        load = link.near.expect("far", "t1", dst).start_load()
        link.far.call("run_stream", "near", src, dst, "t1", load.epoch, list(range(L)), 101,
                      delay, PAYLOAD, WAIT)
        already_complete = []  # per wait: how many later layers were complete too
        for i in range(L):
            load.wait_for_layer(i, WAIT)
            got = link.raw[i, dst]  # a copy (fancy indexing), taken at once
            assert_layer(got, want[i], i, "after wait_for_layer returned")
            assert load.layers_ready()[i]
            already_complete.append(sum(np.array_equal(link.raw[j, dst], want[j])
                                        for j in range(i + 1, L)))
        record_property("later_layers_already_complete", already_complete)
        assert load.wait_all(WAIT) == PAYLOAD
        assert load.payload == PAYLOAD
        assert load.state == StreamState.DONE
        assert load.layers_ready() == [True] * L
        for i in range(L):
            assert_layer(link.raw[i, dst], want[i], i, "after wait_all")
        result = link.far.call("join_stream", "t1", WAIT)
        assert result["error"] is None
        assert result["state"] == "DONE"

    sent = result["layer_times"]
    received = load.layer_times()
    assert all(p is not None and t is not None for p, t in sent), sent
    assert all(t is not None for t in received), received
    for i in range(L):
        assert sent[i][0] <= sent[i][1], f"layer {i} landed before it was posted: {sent[i]}"
        assert received[i] >= sent[i][0], f"layer {i} was in here before the sender posted it"
    assert received[0] < sent[L - 1][0], "layer 0 came only after the last layer was posted"


@pytest.mark.parametrize("mapping, delay", [("contiguous", 0.0), ("scattered", 0.0),
                                            ("scattered", 0.003)],
                         ids=["contiguous-burst", "scattered-burst", "scattered-paced"])
def test_a_layer_is_never_ready_before_its_bytes(link, mapping, delay, record_property):
    """Test 2. 48 layers of 16 blocks (256 KiB a layer, one put per layer when the blocks are
    contiguous, 16 when scattered), saved in shuffled order: as fast as the sender can write
    them (many layers in flight at once), or 3 ms apart. Here a tight loop polls
    layers_ready(); the instant a layer flips to ready its bytes are copied and must be exact.
    A layer once ready stays ready."""
    n = 16
    rid = f"t2-{mapping}-{delay}"
    rng = random.Random(rid)
    order = list(range(L))
    rng.shuffle(order)
    seed = rng.randrange(1 << 30)
    with link.request(n) as (src, dst):
        if mapping == "scattered":
            dst = list(dst)
            rng.shuffle(dst)
        want = expected(seed, n)
        load = link.near.expect("far", rid, dst).start_load()
        link.far.call("run_stream", "near", src, dst, rid, load.epoch, order, seed, delay,
                      PAYLOAD, WAIT)
        seen = [False] * L
        polls_with_news = 0
        deadline = time.monotonic() + WAIT
        while not all(seen):
            ready = load.layers_ready()
            new = [i for i in range(L) if ready[i] and not seen[i]]
            copies = {i: link.raw[i, dst] for i in new}  # copy first, compare after
            for i in range(L):
                assert ready[i] or not seen[i], f"layer {i} was ready, and is not any more"
            for i, got in copies.items():
                assert_layer(got, want[i], i, "the instant layers_ready() reported it")
                seen[i] = True
            polls_with_news += bool(new)
            assert time.monotonic() < deadline, f"only {sum(seen)} of {L} layers in after {WAIT} s"
        assert load.wait_all(WAIT) == PAYLOAD
        result = link.far.call("join_stream", rid, WAIT)
        assert (result["state"], result["error"]) == ("DONE", None)
        for i in range(L):
            assert_layer(link.raw[i, dst], want[i], i, "after wait_all")
    record_property("polls_that_saw_layers_flip", polls_with_news)
    if delay:
        # Paced over 150 ms, the loop must have seen states in between (else it checked
        # nothing while the stream ran); a burst may land between two polls.
        assert polls_with_news >= 2, "every layer flipped within one poll: nothing observed"


def test_sender_abort_ends_the_receivers_wait_promptly(link):
    """Test 4, with k of the layers saved (k = 0, 7, 48 follow below): the receiver's pending
    wait raises TransferError well before its deadline; the sender is ABORTED and refuses
    further saves. See _abort_after."""
    _abort_after(link, 7)


@pytest.mark.parametrize("k", [0, L], ids=["nothing-saved", "all-saved"])
def test_sender_abort_with_none_or_all_layers_saved(link, k):
    _abort_after(link, k)


def _abort_after(link: Link, k: int) -> None:
    """Far saves layers 0..k-1 and aborts; here a wait pends (for layer k, or wait_all when
    every layer was saved). abort() returns once every posted layer landed and the Abort is
    out, so afterwards:

    * the receiver saw exactly the saved layers as ready, with exact bytes, and no more;
    * the sender may reuse its blocks (it overwrites them), and the receiver may free its own:
      nothing of the aborted stream lands later (checked after a complete stream on the same
      connection, which the transport orders after everything before it).
    """
    rid = f"t4-{k}"
    with link.request(6) as (src, dst):
        want = expected(404, 6)
        load = link.near.expect("far", rid, dst).start_load()
        link.far.call("stream_to", "near", src, dst, rid, load.epoch)
        link.far.call("write_layers", 404, list(range(L)), src)
        link.far.call("save_layers", rid, list(range(k)))
        waiter = Background(load.wait_for_layer, k, LONG) if k < L else \
            Background(load.wait_all, LONG)
        assert waiter.pending(), "the wait returned although the sender is not done"

        start = time.monotonic()
        link.far.call("abort", rid, WAIT)
        waiter.join(LONG)
        with pytest.raises(TransferError, match="aborted") as excinfo:
            waiter.get()
        names(excinfo, rid, "'far'")
        assert waiter.ended_at - start < PROMPT

        assert link.far.call("state", rid) == "ABORTED"
        with pytest.raises(ChildError, match="after abort") as excinfo:
            link.far.call("save_layers", rid, [min(k, L - 1)])
        assert excinfo.value.kind == "ConfigError"
        with pytest.raises(ChildError, match="already aborted") as excinfo:
            link.far.call("finish", rid, b"late")
        assert excinfo.value.kind == "ConfigError"
        with pytest.raises(ChildError, match="was aborted") as excinfo:
            link.far.call("wait_for_save", rid, WAIT)
        assert excinfo.value.kind == "TransferError"

        assert load.state == StreamState.ABORTED
        with pytest.raises(TransferError, match="aborted"):
            load.wait_all(WAIT)
        # Layers never saved are not ready; a saved one may be, or may have been awaiting its
        # checksum check (on by default) when the abort ended the load: its bytes are checked.
        assert not any(load.layers_ready()[k:])
        snapshot = link.raw[:, dst].copy()
        for i in range(k):
            assert_layer(snapshot[i], want[i], i, "after the abort")
        assert not snapshot[k:].any(), "a layer that was never saved arrived"

        # The sender reuses its blocks, the receiver's stay as they are.
        link.far.call("write_layers", 405, list(range(L)), src)
        _sync(link, f"{rid}-sync")
        np.testing.assert_array_equal(link.raw[:, dst], snapshot)
        link.far.call("forget", rid)


def _sync(link: Link, rid: str) -> None:
    """A complete one-block stream far -> near (its blocks freed again): every put far posted
    before it has landed once it is done."""
    with link.request(1) as (src, dst):
        load = link.near.expect("far", rid, dst).start_load()
        link.far.call("run_stream", "near", src, dst, rid, load.epoch, list(range(L)), 7, 0.0,
                      b"", WAIT)
        assert load.wait_all(WAIT) == b""
        assert link.far.call("join_stream", rid, WAIT)["state"] == "DONE"


def test_dropping_an_open_save_stream_aborts_it(link):
    """Test 11. The far side drops its SaveStream after saving 5 layers (del + gc.collect()):
    the stream is aborted, so the receiver's pending wait raises TransferError at once instead
    of waiting for a final message that will never come; the 5 layers are in, exactly."""
    with link.request(4) as (src, dst):
        want = expected(1111, 4)
        load = link.near.expect("far", "t11", dst).start_load()
        link.far.call("stream_to", "near", src, dst, "t11", load.epoch)
        link.far.call("write_layers", 1111, list(range(5)), src)
        link.far.call("save_layers", "t11", list(range(5)))
        waiter = Background(load.wait_for_layer, 5, LONG)
        assert waiter.pending()
        start = time.monotonic()
        link.far.call("drop", "t11")
        waiter.join(LONG)
        with pytest.raises(TransferError, match="aborted by its sender 'far'"):
            waiter.get()
        assert waiter.ended_at - start < PROMPT
        assert load.state == StreamState.ABORTED
        # Saved layers only (one that landed may still have been awaiting its checksum
        # check when the abort ended the load); their bytes are checked below.
        assert not any(load.layers_ready()[5:])
        for i in range(5):
            assert_layer(link.raw[i, dst], want[i], i, "after the drop")


# ---------------------------------------------------------------------------------------------
# Test 7: blocks accounted for.

@pytest.mark.parametrize("outcome", ["done", "abort", "drop", "cancel"])
def test_blocks_can_be_freed_and_reused_whatever_the_outcome(link, outcome):
    """Test 7. Each side allocates the request's blocks from its cache's BlockPool, and frees
    them once the stream ended (done, aborted by the sender, dropped, or cancelled by the
    receiver, which tells the sender to stop) and the receiver's lease was released.
    Streaming takes no reference on any block (the pool sees only ours), both pools are all
    free afterwards, and the freed blocks can be handed to a new request at once: it lands
    exactly, and nothing else of the near cache changes (no late write of the old stream)."""
    n, half, rid = 5, L // 2, f"t7-{outcome}"
    far_free, near_free = link.pools()
    src, dst = link.far_ids(n), link.near_ids(n)
    load = link.near.expect("far", rid, dst).start_load()
    if outcome == "done":
        link.far.call("run_stream", "near", src, dst, rid, load.epoch, list(range(L)), 707, 0.0,
                      b"ok", WAIT)
    else:
        link.far.call("stream_to", "near", src, dst, rid, load.epoch)
        link.far.call("write_layers", 707, list(range(L)), src)
        link.far.call("save_layers", rid, list(range(half)))
    assert [link.cache.pool.ref_count(i) for i in dst] == [1] * n
    assert link.cache.pool.num_used == NUM_BLOCKS - near_free + n
    assert link.far.call("num_free") == far_free - n

    if outcome == "done":
        assert load.wait_all(WAIT) == b"ok"
        assert link.far.call("join_stream", rid, WAIT)["state"] == "DONE"
    elif outcome == "cancel":
        load.wait_for_layer(half - 1, WAIT)
        load.cancel()
        with pytest.raises(TransferError, match="cancelled"):
            load.wait_all(WAIT)
        # The sender is told to stop: it flushes what it posted and answers with an Abort;
        # only then is the lease released.
        assert load.wait_released(WAIT)
        with pytest.raises(ChildError, match="cancelled by its receiver") as excinfo:
            link.far.call("wait_for_save", rid, WAIT)
        assert excinfo.value.kind == "TransferError"
        assert link.far.call("state", rid) == "ABORTED"
        with pytest.raises(ChildError, match="cancelled by its receiver"):
            link.far.call("save_layers", rid, [L - 1])
    elif outcome == "abort":
        link.far.call("abort", rid, WAIT)
        with pytest.raises(TransferError, match="aborted"):
            load.wait_all(WAIT)
    else:
        link.far.call("drop", rid)
        with pytest.raises(TransferError, match="aborted"):
            load.wait_all(WAIT)
    assert [link.cache.pool.ref_count(i) for i in dst] == [1] * n
    assert load.wait_released(WAIT)  # whatever the outcome, the blocks may now be reused
    link.far.call("free", src)
    link.cache.pool.free(dst)
    link.far.call("forget", rid)
    assert link.pools() == (far_free, near_free)
    assert link.cache.pool.num_used == NUM_BLOCKS - near_free

    # The blocks go to the next request at once.
    before = link.raw.copy()
    with link.request(n) as (src2, dst2):
        load2 = link.near.expect("far", f"{rid}-next", dst2).start_load()
        link.far.call("run_stream", "near", src2, dst2, f"{rid}-next", load2.epoch,
                      list(range(L)), 708, 0.0, b"next", WAIT)
        assert load2.wait_all(WAIT) == b"next"
        assert link.far.call("join_stream", f"{rid}-next", WAIT)["state"] == "DONE"
        _sync(link, f"{rid}-sync")
        after = link.raw.copy()
        want = expected(708, n)
        for i in range(L):
            assert_layer(after[i, dst2], want[i], i, "in the blocks of the next request")
        others = [b for b in range(NUM_BLOCKS) if b not in dst2]
        changed = [b for b in others if not np.array_equal(after[:, b], before[:, b])]
        # Only the one-block sync stream may have written elsewhere (into a block it freed).
        assert len(changed) <= 1, f"blocks {changed} changed, outside the new request's"
    assert link.pools() == (far_free, near_free)


# ---------------------------------------------------------------------------------------------
# Test 8: a stream before start_load, and one before its lease.

def test_a_stream_that_finished_before_start_load_is_applied(link):
    """Test 8. The receiver leased the blocks (expect) but has not called start_load() when
    the sender streams every layer, finishes and is acknowledged (DONE). The lease took it all
    as it landed: the load is DONE, start_load() still works (vLLM calls it before waiting),
    wait_all returns the payload, and every byte is right."""
    rid = "t8-late-start"
    with link.request(6) as (src, dst):
        load = link.near.expect("far", rid, dst)
        link.far.call("run_stream", "near", src, dst, rid, load.epoch, list(range(L)), 808,
                      0.0, PAYLOAD, WAIT)
        assert link.far.call("join_stream", rid, WAIT)["state"] == "DONE"
        assert load.state == StreamState.DONE and load.released
        assert load.start_load() is load
        assert load.layers_ready() == [True] * L
        assert load.wait_all(WAIT) == PAYLOAD
        want = expected(808, 6)
        for i in range(L):
            load.wait_for_layer(i, 0)
            assert_layer(link.raw[i, dst], want[i], i, "after a late start_load")


def test_a_stream_into_a_lease_never_granted_writes_nothing(link):
    """Test 8, before the lease: the sender streams into an epoch of near's that near never
    granted (as a sender would whose control plane raced ahead of the receiver, or replays an
    old request). near refuses the Begin: the stream fails naming the refusal, and not one
    byte of near's cache changed."""
    with link.request(3) as (src, dst):
        before = link.raw.copy()
        refused = link.near.stats().begins_refused
        epoch = (link.near.incarnation << 32) | 0xABCDEF
        link.far.call("run_stream", "near", src, dst, "t8-no-lease", epoch, list(range(L)),
                      818, 0.0, b"", WAIT)
        result = link.far.call("join_stream", "t8-no-lease", WAIT)
        assert result["state"] == "FAILED"
        assert result["error"][0] == "TransferError"
        assert "refused" in result["error"][1] and "nothing was written" in result["error"][1]
        assert link.near.stats().begins_refused == refused + 1
        _sync(link, "t8-no-lease-sync")
        changed = np.flatnonzero((link.raw != before).any(axis=(0, 2)))
        assert len(changed) <= 1, f"blocks {changed} changed (only the sync's one may)"


def test_an_abort_before_start_load_is_applied(link):
    """Test 8, aborted: the sender saved 3 layers and aborted before the receiver started;
    start_load works, the load is ABORTED with the 3 layers in place, the waits raise
    TransferError, and the lease is released."""
    with link.request(3) as (src, dst):
        load = link.near.expect("far", "t8-abort", dst)
        link.far.call("stream_to", "near", src, dst, "t8-abort", load.epoch)
        link.far.call("write_layers", 818, list(range(3)), src)
        link.far.call("save_layers", "t8-abort", [0, 1, 2])
        link.far.call("abort", "t8-abort", WAIT)
        assert load.wait_released(WAIT)
        load.start_load()
        assert load.state == StreamState.ABORTED
        assert not any(load.layers_ready()[3:])  # as above: saved layers only
        with pytest.raises(TransferError, match="aborted"):
            load.wait_for_layer(3, WAIT)
        with pytest.raises(TransferError, match="aborted"):
            load.wait_all(WAIT)
        want = expected(818, 3, range(3))
        for i in range(3):
            assert_layer(link.raw[i, dst], want[i], i, "after start_load applied the abort")
        link.far.call("forget", "t8-abort")


# ---------------------------------------------------------------------------------------------
# Test 9: concurrent streams, and a request id used again.

def test_two_concurrent_streams_to_one_peer_interleave(link):
    """Test 9. Two requests from far to near at once, their layers saved alternately (one in
    ascending, one in descending order): both complete, each with its own payload, its own
    bytes in its own blocks. Then the first request id is used again for a new stream, with
    new data: it works too."""
    with link.request(4) as (src_a, dst_a), link.request(3) as (src_b, dst_b):
        load_a = link.near.expect("far", "t9-a", dst_a).start_load()
        load_b = link.near.expect("far", "t9-b", dst_b).start_load()
        link.far.call("stream_to", "near", src_a, dst_a, "t9-a", load_a.epoch)
        link.far.call("stream_to", "near", src_b, dst_b, "t9-b", load_b.epoch)
        link.far.call("write_layers", 901, list(range(L)), src_a)
        link.far.call("write_layers", 902, list(range(L)), src_b)
        link.far.call("save_each", [pair for i in range(L)
                                    for pair in (("t9-a", i), ("t9-b", L - 1 - i))])
        link.far.call("finish", "t9-b", b"payload-b")
        link.far.call("finish", "t9-a", b"payload-a")
        assert load_a.wait_all(WAIT) == b"payload-a"
        assert load_b.wait_all(WAIT) == b"payload-b"
        link.far.call("wait_for_save", "t9-a", WAIT)
        link.far.call("wait_for_save", "t9-b", WAIT)
        assert (link.far.call("state", "t9-a"), link.far.call("state", "t9-b")) == ("DONE",) * 2
        for seed, n, dst in ((901, 4, dst_a), (902, 3, dst_b)):
            want = expected(seed, n)
            for i in range(L):
                assert_layer(link.raw[i, dst], want[i], i, f"of stream {seed}")
        link.far.call("forget", "t9-a")
        link.far.call("forget", "t9-b")

        # The same request id again, same blocks, new data.
        again = link.near.expect("far", "t9-a", dst_a).start_load()
        link.far.call("run_stream", "near", src_a, dst_a, "t9-a", again.epoch, list(range(L)),
                      903, 0.0, b"again", WAIT)
        assert again.wait_all(WAIT) == b"again"
        assert link.far.call("join_stream", "t9-a", WAIT)["state"] == "DONE"
        want = expected(903, 4)
        for i in range(L):
            assert_layer(link.raw[i, dst_a], want[i], i, "of the reused request id")


# ---------------------------------------------------------------------------------------------
# Test 10: mismatched destination.

def test_a_stream_into_other_blocks_than_leased_is_refused(link):
    """Test 10. The receiver leased blocks X for request "t10"; the sender streams "t10" with
    that lease's epoch into blocks Y. The receiver refuses the Begin (the ids' hash differs):
    the sender's stream fails naming it, nothing is written (neither X nor Y), and the
    receiver's lease stands until it is cancelled, which releases it at once (no sender ever
    engaged it)."""
    with link.request(4) as (src, x):
        y = link.near_ids(4)
        try:
            before = link.raw.copy()
            load = link.near.expect("far", "t10", x).start_load()
            link.far.call("run_stream", "near", src, y, "t10", load.epoch, list(range(L)), 1010,
                          0.0, b"", WAIT)
            result = link.far.call("join_stream", "t10", WAIT)
            assert result["state"] == "FAILED" and result["error"][0] == "TransferError"
            assert "other blocks" in result["error"][1], result
            assert load.state == StreamState.OPEN and not load.released
            load.cancel()
            assert load.released
            with pytest.raises(TransferError, match="cancelled"):
                load.wait_all(WAIT)
            _sync(link, "t10-sync")
            assert np.array_equal(link.raw[:, x], before[:, x]), "the leased blocks were written"
            assert np.array_equal(link.raw[:, y], before[:, y]), "the other blocks were written"
        finally:
            link.cache.pool.free(y)


# ---------------------------------------------------------------------------------------------
# The sender's deadline.

def test_wait_for_save_times_out_while_the_receiver_cannot_ack(link):
    """Here is the sender: with the far receiver stopped (SIGSTOP) it cannot acknowledge the
    final message, so wait_for_save raises TimeoutError naming the request, the peer and its
    deadline; the stream is still OPEN, and completes once the receiver runs again."""
    with link.request(2) as (dst, src):  # far receives into dst, near sends from src
        link.raw[:, src] = pattern(1212, L, 2, BLOCK)
        epoch = link.far.call("expect", "near", "t-timeout", dst)
        stream = link.near.stream_to("far", src, dst, "t-timeout", epoch=epoch)
        for i in range(L):
            stream.save_layer(i)
        link.far.pause()
        try:
            stream.finish(b"late")
            start = time.monotonic()
            with pytest.raises(TimeoutError) as excinfo:
                stream.wait_for_save(0.3)
            assert time.monotonic() - start >= 0.3
            names(excinfo, "'t-timeout'", "'far'", "0.3 s", f"of {L} layers landed")
            assert stream.state == StreamState.OPEN
        finally:
            link.far.resume()
        stream.wait_for_save(WAIT)
        assert stream.state == StreamState.DONE
        assert link.far.call("wait_all", "t-timeout", WAIT) == b"late"
        np.testing.assert_array_equal(link.far.call("blocks", dst), link.raw[:, src])
        link.far.call("forget", "t-timeout")


# ---------------------------------------------------------------------------------------------
# Tests 5 and 6: a process killed mid-stream.

def test_sigkill_of_the_sender_fails_the_receivers_waits_with_peer_error():
    """Test 5. The far sender saved 6 layers (they are in, exactly) and is SIGKILLed; the
    receiver's pending waits (a layer not saved, and wait_all) raise PeerError naming it, long
    before their 30 s deadline. Nothing else arrives, the load is FAILED, the dead peer is
    refused, and the receiver's blocks go back to its pool."""
    link = Link("survivor-r", "doomed-sender")
    try:
        src, dst = link.far_ids(4), link.near_ids(4)
        want = expected(505, 4, range(6))
        load = link.near.expect("doomed-sender", "t5", dst).start_load()
        link.far.call("stream_to", "survivor-r", src, dst, "t5", load.epoch)
        link.far.call("write_layers", 505, list(range(L)), src)
        link.far.call("save_layers", "t5", list(range(6)))
        for i in range(6):
            load.wait_for_layer(i, WAIT)
            assert_layer(link.raw[i, dst], want[i], i, "before the kill")
        layer_wait = Background(load.wait_for_layer, 6, LONG)
        all_wait = Background(load.wait_all, LONG)
        assert layer_wait.pending() and all_wait.pending()

        killed = time.monotonic()
        os.kill(link.far.pid, signal.SIGKILL)
        for waiter in (layer_wait, all_wait):
            waiter.join(LONG)
            with pytest.raises(PeerError, match="doomed-sender"):
                waiter.get()
            assert waiter.ended_at - killed < PROMPT, "a dead sender went unnoticed"
        assert load.state == StreamState.FAILED
        with pytest.raises(PeerError, match="doomed-sender"):
            load.wait_for_layer(7, WAIT)
        for i in range(6):
            assert_layer(link.raw[i, dst], want[i], i, "after the kill")
        assert not link.raw[6:, dst].any(), "a layer that was never saved arrived"
        with pytest.raises(PeerError, match="doomed-sender") as excinfo:
            link.near.expect("doomed-sender", "t5-next", dst)
        names(excinfo, "failed")

        link.cache.pool.free(dst)
        assert link.cache.pool.num_free == NUM_BLOCKS
        link.near.remove_peer("doomed-sender")
        assert link.near.peers == []
    finally:
        link.close()


@pytest.mark.parametrize("when", ["mid-stream", "awaiting-ack"])
def test_death_of_the_receiver_fails_wait_for_save_with_peer_error(when):
    """Test 6. The far receiver is SIGKILLed either after 10 layers landed (the sender then
    saves the rest, which may already be refused with PeerError) or once every layer landed
    and the final message waits for its acknowledgement (the receiver is stopped first, so it
    cannot ack). wait_for_save raises PeerError naming the receiver, long before its deadline;
    the stream is FAILED, the dead peer refused, and the sender's blocks go back to its pool."""
    link = Link("survivor-s", f"doomed-{when}")
    peer = f"doomed-{when}"
    try:
        src, dst = link.near_ids(4), link.far_ids(4)
        for i in range(L):
            write_layer(link.cache, 606, i, src)
        epoch = link.far.call("expect", "survivor-s", "t6", dst)
        stream = link.near.stream_to(peer, src, dst, "t6", epoch=epoch)
        if when == "mid-stream":
            for i in range(10):
                stream.save_layer(i)
            link.far.call("wait_for_layer", "t6", 9, WAIT)
            killed = time.monotonic()
            os.kill(link.far.pid, signal.SIGKILL)
            try:
                for i in range(10, L):
                    stream.save_layer(i)
            except PeerError as e:
                assert peer in str(e)
        else:
            for i in range(L):
                stream.save_layer(i)
            link.far.call("wait_for_layer", "t6", L - 1, WAIT)
            link.far.pause()
            stream.finish(b"never-acked")
            with pytest.raises(TimeoutError):
                stream.wait_for_save(0.2)
            killed = time.monotonic()
            os.kill(link.far.pid, signal.SIGKILL)
        waiter = Background(stream.wait_for_save, LONG).join(LONG)
        with pytest.raises(PeerError, match=peer):
            waiter.get()
        assert waiter.ended_at - killed < PROMPT, "a dead receiver went unnoticed"
        assert stream.state == StreamState.FAILED
        with pytest.raises(PeerError, match=peer):
            link.near.stream_to(peer, src, dst, "t6-next", epoch=epoch + 1)

        link.cache.pool.free(src)
        assert link.cache.pool.num_free == NUM_BLOCKS
    finally:
        link.close()
