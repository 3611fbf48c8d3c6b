"""Never serve stale KV (``csrc/stream/stream_protocol.h``): leases, cancel, peer restarts,
checksums and injected faults, between real processes over UCX.

The failure these tests rule out is the field's most reported one: a receiver gives up on a
slow transfer, gives the blocks to the next request, and the first transfer's sender writes
into them later (vLLM #52234, aws-do-eks #84). Each test makes a sender late in some way and
then checks, byte for byte, that the blocks' new owner kept its bytes.

Set-up: this process is the receiver ("dec", decode side); the sender ("pre") runs in a
spawned child (``helpers.stream_far.StreamFar``), both over tcp loopback with peer error
handling. Every wait has a deadline.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvmove
from kvmove import StreamState
from kvmove.agent_stats import trouble_note
from kvmove.bench.harness import ChildError
from kvmove.errors import ChecksumError, PeerError, TimeoutError, TransferError

from helpers.checks import wait_until, within
from helpers.far import FarPeer
from helpers.kv import digest_blocks, layer_data, make_cache, raw_view
from helpers.stream_far import StreamFar
from helpers.stress_far import StressSender

LAYOUT = dict(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)
L = 8
BLOCK = 16 * 2 * 64 * 2 * 2  # 8 KiB a block per layer
NUM_BLOCKS = 24
AGENT = {"transports": "tcp", "error_mode": "peer", "peer_timeout": 2.0,
         "cancel_timeout": 1.0, "ack_timeout": 2.0}
WAIT = 10.0


class Pair:
    """The receiver "dec" here, the sender "pre" in a child, peers of each other."""

    def __init__(self, sender_kwargs: dict | None = None, host: type = StreamFar,
                 receiver_kwargs: dict | None = None) -> None:
        self.far = FarPeer("pre", LAYOUT, 64, {**AGENT, **(sender_kwargs or {})}, host=host)
        try:
            self.cache = make_cache(LAYOUT, NUM_BLOCKS)
            self.raw = raw_view(self.cache)
            self.dec = kvmove.Agent("dec", self.cache, **{**AGENT, **(receiver_kwargs or {})})
            host_port = self.dec.listen()
            assert self.far.call("connect", *host_port) == "dec"
        except BaseException:
            self.far.stop()
            raise

    def lease(self, rid: str, n: int, timeout: float) -> tuple[kvmove.LoadStream, list[int]]:
        ids = self.cache.pool.allocate(n)
        assert ids is not None
        return self.dec.expect("pre", rid, ids, timeout=timeout).start_load(), ids

    def sender_blocks(self, n: int) -> list[int]:
        return self.far.call("allocate", n)

    def fill_new(self, ids: list[int], seed: int) -> np.ndarray:
        """Streams ``n`` blocks of ``seed``'s data into a fresh lease of ``ids`` and returns
        what they hold once it is done (the new owner's KV)."""
        load = self.dec.expect("pre", f"new-{seed}", ids, timeout=WAIT).start_load()
        src = self.sender_blocks(len(ids))
        self.far.call("run_stream", "dec", src, ids, f"new-{seed}", load.epoch, list(range(L)),
                      seed, 0.0, b"new", WAIT)
        assert load.wait_all(WAIT) == b"new"
        assert self.far.call("join_stream", f"new-{seed}", WAIT)["state"] == "DONE"
        self.far.call("free", src)
        for layer in range(L):
            np.testing.assert_array_equal(self.raw[layer, ids],
                                          layer_data(seed, layer, len(ids), BLOCK))
        return self.raw[:, ids].copy()

    def sync(self) -> None:
        """A complete stream: everything the sender posted before it has landed."""
        ids = self.cache.pool.allocate(1)
        self.fill_new(ids, 777)
        self.cache.pool.free(ids)

    def close(self) -> None:
        try:
            within(15, self.dec.close)
        finally:
            self.far.stop()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def _all_released(pair: Pair) -> None:
    stats = pair.dec.stats()
    assert (stats.leases_active, stats.blocks_quarantined) == (0, 0), stats
    assert pair.cache.pool.num_free == NUM_BLOCKS


# --- the reproduced failure -------------------------------------------------------------------

def test_a_sender_late_after_the_lease_expired_changes_no_byte_of_the_next_request(pair):
    """The issue's reproduction, on raw agents: the receiver leases blocks X for request
    "old" with a short deadline; the sender has not begun when it passes. The lease expires
    (nobody engaged it: released at once), X goes to request "new", whose KV lands. Then the
    old request's sender runs: every layer saved, finished. It is refused at its Begin, and
    0 bytes of the new request's blocks change."""
    old, ids = pair.lease("old", 4, timeout=0.2)
    with pytest.raises(TimeoutError, match=r"expired: .*\(no Begin from the sender arrived\)"):
        old.wait_all(WAIT)
    assert old.released and pair.dec.stats().leases_expired == 1
    assert pair.dec.stats().trouble() == "leases_expired=1"   # what a failure's log line adds
    assert trouble_note([pair.dec]) == "; agent dec: leases_expired=1"
    pair.cache.pool.free(ids)
    new_ids = pair.cache.pool.allocate(4)
    assert sorted(new_ids) == sorted(ids), "the allocator gives the freed blocks back"
    before = pair.fill_new(new_ids, 2002)

    src = pair.sender_blocks(4)
    pair.far.call("run_stream", "dec", src, ids, "old", old.epoch, list(range(L)), 1001, 0.0,
                  b"late", WAIT)
    result = pair.far.call("join_stream", "old", WAIT)
    assert result["state"] == "FAILED" and result["error"][0] == "TransferError", result
    assert "refused" in result["error"][1] and "nothing was written" in result["error"][1]
    pair.sync()
    changed = int(np.count_nonzero(pair.raw[:, new_ids] != before))
    assert changed == 0, f"{changed} bytes of the new request's KV were overwritten"
    assert pair.dec.stats().begins_refused == 1
    pair.cache.pool.free(new_ids)
    pair.far.call("free", src)
    _all_released(pair)


def test_a_slow_sender_is_cancelled_and_its_blocks_come_back_only_after_it_stopped(pair):
    """The sender engaged the lease (Go) and saves a layer every 100 ms; the lease expires
    after ~0.25 s. The receiver's waits fail at the deadline, the blocks are quarantined
    (not released) until the sender answered the Cancel: it drops its queued layers, lets the
    posted ones land and aborts. Only then are they released and reused, and the next
    request's KV stays exact: no late layer of the old stream lands in it."""
    old, ids = pair.lease("slow", 4, timeout=0.25)
    src = pair.sender_blocks(4)
    pair.far.call("run_stream", "dec", src, ids, "slow", old.epoch, list(range(L)), 3003, 0.1,
                  b"", WAIT)
    with pytest.raises(TimeoutError, match=r"expired: .*\(the sender began; \d+ of "
                                           rf"{L} layers landed, no Final\)"):
        old.wait_all(WAIT)
    assert old.wait_released(WAIT), "the sender never answered the Cancel"
    landed = sum(old.layers_ready())
    assert 0 < landed < L, f"{landed} layers landed: the lease should have expired mid-stream"
    result = pair.far.call("join_stream", "slow", WAIT)
    assert result["state"] == "ABORTED", result
    assert "cancelled by its receiver" in str(result["error"]), result
    pair.cache.pool.free(ids)
    new_ids = pair.cache.pool.allocate(4)
    before = pair.fill_new(new_ids, 4004)
    time.sleep(0.5)  # the old stream would have saved (and posted) its remaining layers by now
    pair.sync()
    assert np.array_equal(pair.raw[:, new_ids], before), "a late layer landed in reused blocks"
    stats = pair.dec.stats()
    assert stats.cancels_sent == 1 and stats.senders_disconnected == 0
    pair.cache.pool.free(new_ids)
    pair.far.call("free", src)
    _all_released(pair)


# The three ways a same-host sender reaches the receiver's memory: its mapping (memcpy), UCX
# shared memory (and cma), UCX tcp (emulated puts, applied by the receiver's worker).
CUT_OFF_PATHS = [
    pytest.param({"same_host": "map"}, id="mapped"),
    pytest.param({"same_host": "ucx", "transports": "sm", "error_mode": "none"}, id="shm"),
    pytest.param({"same_host": "ucx"}, id="tcp"),
]


def _engaged_then_stopped(pair: Pair) -> tuple[kvmove.LoadStream, list[int]]:
    """A lease of 4 blocks (0.3 s), engaged: the sender streamed 2 of its layers into it and
    is then stopped (SIGSTOP) with the rest to save. Its load, and the blocks."""
    old, ids = pair.lease("frozen", 4, timeout=0.3)
    src = pair.sender_blocks(4)
    pair.far.call("stream_to", "dec", src, ids, "frozen", old.epoch)
    pair.far.call("write_layers", 5005, list(range(L)), src)
    pair.far.call("save_layers", "frozen", [0, 1])
    old.wait_for_layer(1, WAIT)
    pair.far.pause()
    return old, ids


@pytest.mark.parametrize("path", CUT_OFF_PATHS)
def test_a_silent_sender_is_cut_off_and_its_blocks_stay_quarantined_while_it_lives(path):
    """The sender engaged the lease and is then stopped (SIGSTOP) mid-stream, layers still
    to save: it cannot answer the Cancel. After the cancel timeout the receiver disconnects
    it, but its blocks stay quarantined (the load failed; not released, counted) for as long
    as its process lives: resumed, it could still write them by any of these paths, late
    copies it had queued first of all (issue 27: 62-66 MB landed in reused blocks). Once its
    process exited they are released, and a new owner's bytes are never touched."""
    pair = Pair(sender_kwargs=path, receiver_kwargs=path)
    try:
        old, ids = _engaged_then_stopped(pair)
        try:
            with pytest.raises(TimeoutError, match="expired"):
                old.wait_all(WAIT)
            wait_until(lambda: pair.dec.stats().senders_disconnected == 1, WAIT,
                       "the silent sender cut off")
            assert "pre" not in pair.dec.peers
        finally:
            pair.far.resume()
        with pytest.raises(ChildError):  # its stream cannot go on: the receiver cut it off
            pair.far.call("save_layers", "frozen", list(range(2, L)))
            pair.far.call("wait_for_save", "frozen", WAIT)
        assert not old.wait_released(1.0), "released while its sender lives"
        stats = pair.dec.stats()
        assert (stats.blocks_quarantined, stats.leases_quarantined) == (4, 1), stats
        pair.far.kill()
        assert old.wait_released(WAIT), "still quarantined after its sender exited"
        assert pair.dec.stats().blocks_quarantined == 0
        pair.raw[:, ids] = 0x5A  # the blocks' next owner
        time.sleep(0.3)
        assert (pair.raw[:, ids] == 0x5A).all()
        pair.cache.pool.free(ids)
    finally:
        pair.close()


@pytest.mark.parametrize("path", CUT_OFF_PATHS)
def test_a_cut_off_sender_that_reconnects_ends_the_quarantine_with_its_abort(path):
    """Issue 27/28: the quarantine of a live sender is not for ever. The silent sender is cut
    off, resumed, and connects again (the same run: fresh endpoints both ways). The receiver
    cancels its quarantined lease anew; the sender, with nothing of it in flight any more
    (its old connection's copies done), answers Abort, and the blocks are released while it
    lives. The pair then serves a new stream exactly."""
    pair = Pair(sender_kwargs=path, receiver_kwargs=path)
    try:
        old, ids = _engaged_then_stopped(pair)
        try:
            wait_until(lambda: pair.dec.stats().senders_disconnected == 1, WAIT,
                       "the silent sender cut off")
        finally:
            pair.far.resume()
        assert not old.released and pair.dec.stats().leases_quarantined == 1
        assert pair.far.call("connect", *pair.dec.listen_address) == "dec"
        assert old.wait_released(WAIT), "the reconnected sender never ended the quarantine"
        assert pair.dec.stats().blocks_quarantined == 0
        pair.cache.pool.free(ids)
        new_ids = pair.cache.pool.allocate(4)
        new_kv = pair.fill_new(new_ids, 6006)
        time.sleep(0.3)
        pair.sync()
        np.testing.assert_array_equal(pair.raw[:, new_ids], new_kv)
        pair.cache.pool.free(new_ids)
        _all_released(pair)
    finally:
        pair.close()


def test_the_engine_worker_never_gives_a_reused_block_to_a_late_prefill():
    """The issue's reproduction with the engine's Workers: a decode worker gives up on a
    request's KV (its transfer timeout), and its blocks go to a new request whose KV comes
    in. Then the prefill worker runs the old request late. It is refused: the new request's
    prompt KV keeps every byte, and its output equals the colocated one."""
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
    from kvmove.engine.request import FinishReason, Request, SamplingParams
    from kvmove.engine.worker import EngineWorker

    model = LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0)
    kwargs = {"num_blocks": 32, "block_size": 16,
              "agent_kwargs": {"transports": "tcp", "peer_timeout": 2.0}}
    prefill = EngineWorker(model, role="prefill", name="p", **kwargs)
    # The timeout is what the late prefill misses; the new one's prefill must beat it, on a
    # busy machine, so the model is warmed up first (a process's first forward is slow).
    decode = EngineWorker(model, role="decode", name="d", transfer_timeout=1.0, **kwargs)
    colocated = EngineWorker(model, num_blocks=32, block_size=16)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = Request("new", list(range(50, 90)), params)
    colocated.add_request(ref)
    colocated.run()
    try:
        prefill.agent.add_peer(decode.agent.metadata())
        decode.agent.add_peer(prefill.agent.metadata())
        # Each worker has its own Request objects, as in separate processes.
        old = Request("old", list(range(1, 41)), params)
        old_at_prefill = Request("old", list(range(1, 41)), params)
        ids = decode.reserve(old)
        decode.start_load(old, "p")  # its offer waits at the prefill, which does not run
        prefill.add_request(old_at_prefill, decode_peer="d")
        deadline = time.monotonic() + WAIT
        while old.finish_reason is None:  # the prefill does not run: the decode gives up
            decode.step()
            assert time.monotonic() < deadline
        assert old.finish_reason is FinishReason.ABORT and "expired" in old.error
        decode.step()  # its blocks come back (released: no sender engaged the lease)

        new = Request("new", list(range(50, 90)), params)
        new_at_prefill = Request("new", list(range(50, 90)), params)
        new_ids = decode.reserve(new)
        assert set(new_ids) & set(ids), "the new request reuses the old one's blocks"
        prefill_new = EngineWorker(model, role="prefill", name="p2", **kwargs)
        try:
            prefill_new.agent.add_peer(decode.agent.metadata())
            decode.agent.add_peer(prefill_new.agent.metadata())
            decode.start_load(new, "p2")
            prefill_new.add_request(new_at_prefill, decode_peer="d")
            prefill_new.run()
            while not new.output:
                decode.step()
                assert time.monotonic() < deadline
            kv = decode.cache.torch()
            prompt_kv = kv[:, new_ids].clone()
            prefill.run()  # the old request, late: refused, nothing written
            assert old_at_prefill.finish_reason is FinishReason.ABORT
            assert "refused" in old_at_prefill.error and "nothing was written" in \
                old_at_prefill.error
            assert torch_equal(kv[:, new_ids], prompt_kv), "the late prefill wrote new's blocks"
            decode.run()
        finally:
            prefill_new.close()
        assert new.output == ref.output
        assert decode.agent.stats().begins_refused == 1
        assert decode.cache.pool.num_free == 32
    finally:
        prefill.close()
        decode.close()


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


# --- the read-after-reassign stress ------------------------------------------------------------

def test_read_after_reassign_stress_serves_no_stale_block_and_leaks_none():
    """vLLM's read-after-reassign digest harness, on kvmove: a 24-block pool, 300 requests of
    1-4 blocks with 20-80 ms leases, 6 in flight, senders that start late or save slowly at
    random. Every block a request uses is filled by its sender with a digest of (request,
    layer, position); the receiver checks every byte of every block of every completed load,
    when it completes and again when it lets the blocks go (after holding them a while, as a
    decode would). Failed or cancelled loads give their blocks back only once released.
    0 mismatches, both outcomes exercised, every block free at the end, bounded time."""
    rng = random.Random(52234)
    # A short ack timeout: a sender whose Final is not acknowledged must not tie up one of
    # the sender's threads for long (under the old protocol, every late sender's is not).
    pair = Pair(host=StressSender, sender_kwargs={"ack_timeout": 0.3})
    try:
        pool, raw = pair.cache.pool, pair.raw
        total, in_flight_max = 300, 6
        live: dict[str, tuple[kvmove.LoadStream, list[int], int]] = {}
        holding: list[tuple[float, str, list[int], int]] = []
        releasing: list[tuple[kvmove.LoadStream, list[int]]] = []
        issued = done = failed = checked = mismatched = 0
        start = time.monotonic()
        sender_idle, polled = False, 0.0

        def verify(ids: list[int], number: int) -> int:
            bad = 0
            for layer in range(L):
                want = digest_blocks(number, layer, len(ids), BLOCK)
                bad += int(np.count_nonzero((raw[layer, ids] != want).any(axis=1)))
            return bad

        # Until the sender is idle too: a late write must find the blocks still in use.
        while issued < total or live or holding or releasing or not sender_idle:
            assert time.monotonic() - start < 120, "the stress did not finish in 120 s"
            if issued == total and time.monotonic() - polled > 0.05:
                sender_idle, polled = pair.far.call("idle"), time.monotonic()
            if issued < total and len(live) < in_flight_max:
                n = rng.randint(1, 4)
                ids = pool.allocate(n)
                if ids is not None:
                    rid = f"s{issued}"
                    load = pair.dec.expect("pre", rid, ids,
                                           timeout=rng.uniform(0.02, 0.08)).start_load()
                    late = rng.random() < 0.15
                    slow = rng.random() < 0.15
                    pair.far.call("submit", {
                        "rid": rid, "number": issued, "epoch": load.epoch, "dst": ids,
                        "peer": "dec", "start_delay": rng.uniform(0.05, 0.12) if late else 0.0,
                        "layer_delays": [rng.uniform(0.01, 0.03) if slow else 0.0
                                         for _ in range(L)]})
                    live[rid] = (load, ids, issued)
                    issued += 1
            now = time.monotonic()
            for rid, (load, ids, number) in list(live.items()):
                state = load.state
                if state == StreamState.OPEN:
                    continue
                del live[rid]
                if state == StreamState.DONE:
                    done += 1
                    mismatched += verify(ids, number)
                    checked += len(ids)
                    holding.append((now + rng.uniform(0.0, 0.03), rid, ids, number))
                else:
                    failed += 1
                    releasing.append((load, ids))
            for entry in [h for h in holding if h[0] <= now]:
                holding.remove(entry)
                _, _, ids, number = entry
                mismatched += verify(ids, number)  # nothing landed in them while in use
                pool.free(ids)
            for load, ids in [r for r in releasing if r[0].released]:
                releasing.remove((load, ids))
                pool.free(ids)
            time.sleep(0.001)
        assert mismatched == 0, f"{mismatched} stale blocks served (of {checked} checked)"
        outcomes = pair.far.call("outcomes")
        assert done >= 50 and failed >= 20, (done, failed)
        assert len(outcomes) == total
        assert pool.num_free == NUM_BLOCKS, "blocks leaked"
        assert pair.far.call("num_free") == 64, "the sender's blocks leaked"
        stats = pair.dec.stats()
        assert (stats.leases_active, stats.blocks_quarantined) == (0, 0), stats
        assert stats.leases_granted == total
        print(f"stress: {total} requests, {done} done, {failed} failed "
              f"({stats.leases_expired} expired, {stats.cancels_sent} cancels, "
              f"{stats.begins_refused} late senders refused), {checked} blocks checked twice, "
              f"0 stale, {time.monotonic() - start:.1f} s")
    finally:
        pair.close()


# --- peer restarts ------------------------------------------------------------------------------

def test_a_sender_that_restarts_is_taken_back_without_restarting_the_receiver():
    """NIXL #1986 / vLLM #49238 (a segfault in ucp_ep_rkey_unpack when the prefill restarts):
    the receiver holds the sender's old metadata and a load from it; the sender process is
    SIGKILLed and a new one starts under the same name and connects again. The receiver
    replaces the old peer (its remote key dropped before its endpoint), the old load fails with
    PeerError and is released, and a stream from the new incarnation lands exactly."""
    pair = Pair()
    try:
        load, ids = pair.lease("before", 2, timeout=WAIT)
        old_incarnation = pair.far.call("metadata")
        os.kill(pair.far.pid, signal.SIGKILL)
        pair.far.stop()
        pair.far = FarPeer("pre", LAYOUT, 64, AGENT, host=StreamFar)
        assert pair.far.call("connect", *pair.dec.listen_address) == "dec"
        assert pair.far.call("metadata") != old_incarnation
        with pytest.raises(PeerError, match="pre"):
            load.wait_all(WAIT)
        assert load.released
        pair.cache.pool.free(ids)
        assert pair.dec.peers == ["pre"]
        new_ids = pair.cache.pool.allocate(3)
        pair.fill_new(new_ids, 6006)
        pair.cache.pool.free(new_ids)
        _all_released(pair)
    finally:
        pair.close()


def test_a_stalled_old_run_never_writes_into_the_kv_of_the_run_that_replaced_it():
    """Issue 27: a sender is stopped (SIGSTOP, not dead) mid-stream and a new run of it
    connects under its name. The receiver takes the new run at once; the old run's lease fails
    but stays quarantined while the old process lives. The receiver's blocks go back to its
    pool only when a lease is released (as the engine does), so the new run's request gets
    other blocks; the old run, resumed, goes on saving its layers; the new run's KV keeps
    every byte. (Released at the restart, as before, the old blocks were the new run's, and
    the old run overwrote 5.8-11 MB of them.) Once the old process exited, they are free."""
    pair = Pair()
    old_far = pair.far
    try:
        old, old_ids = pair.lease("before", 4, timeout=WAIT)
        src = pair.sender_blocks(4)
        old_far.call("stream_to", "dec", src, old_ids, "before", old.epoch)
        old_far.call("write_layers", 8008, list(range(L)), src)
        old_far.call("save_layers", "before", [0, 1])
        old.wait_for_layer(1, WAIT)
        old_far.pause()
        try:
            pair.far = FarPeer("pre", LAYOUT, 64, AGENT, host=StreamFar)
            assert pair.far.call("connect", *pair.dec.listen_address) == "dec"
            with pytest.raises(PeerError, match="pre"):
                old.wait_all(WAIT)
            if old.released:  # an engine frees a load's blocks once it is released
                pair.cache.pool.free(old_ids)
            assert pair.dec.stats().leases_quarantined == 1
            new_ids = pair.cache.pool.allocate(4)
            assert not set(new_ids) & set(old_ids)
            new_kv = pair.fill_new(new_ids, 9009)
        finally:
            old_far.resume()
        try:  # the old run goes on where it stopped, if its agent lets it
            old_far.call("save_layers", "before", list(range(2, L)))
            old_far.call("wait_for_save", "before", 2.0)
        except ChildError:
            pass
        time.sleep(0.3)
        pair.sync()
        np.testing.assert_array_equal(pair.raw[:, new_ids], new_kv)
        assert not old.wait_released(0.5), "released while the old run lives"
        old_far.kill()
        assert old.wait_released(WAIT)
        pair.cache.pool.free(old_ids)
        pair.cache.pool.free(new_ids)
        _all_released(pair)
    finally:
        old_far.stop()
        pair.close()


def test_a_lease_of_a_receivers_earlier_run_is_refused_by_the_sender():
    """The receiver restarts (new incarnation) while a sender still holds an epoch from its
    earlier run: the sender refuses to stream into it before asking (its epoch's incarnation is
    not the peer's), naming why."""
    pair = Pair()
    try:
        stale_epoch = (pair.dec.incarnation << 32) | 1
        other = kvmove.Agent("dec", make_cache(LAYOUT, NUM_BLOCKS), **AGENT)
        try:
            host_port = other.listen()
            assert pair.far.call("connect", *host_port) == "dec"  # the new run replaces it
            src = pair.sender_blocks(1)
            with pytest.raises(ChildError, match="earlier run") as excinfo:
                pair.far.call("stream_to", "dec", src, [0], "x", stale_epoch)
            assert excinfo.value.kind == "PeerError"
        finally:
            within(15, other.close)
    finally:
        pair.close()


# --- the sender's side ------------------------------------------------------------------------

def test_a_final_that_is_never_acknowledged_fails_the_sender_after_its_ack_timeout():
    """The receiver is paused once every layer landed, so it cannot acknowledge the Final:
    the sender's stream does not stay in "sending" for ever but fails at its ack timeout
    (0.5 s here, well before keepalive would declare the peer dead), so its own blocks come
    back."""
    pair = Pair(receiver_kwargs={"ack_timeout": 0.5})
    try:
        _final_without_ack(pair)
    finally:
        pair.close()


def test_a_begin_never_answered_fails_the_sender_saying_the_begin_left():
    """The receiver is paused before the sender's Begin (on a connection a first stream
    set up): the stream fails at the ack timeout with nothing written, and its message says
    the Begin was sent (the silence is the receiver's or the network's, not a queue here)."""
    pair = Pair(receiver_kwargs={"ack_timeout": 0.5})
    try:
        src = pair.cache.pool.allocate(2)
        epoch = pair.far.call("expect", "dec", "first", [0, 1])
        first = pair.dec.stream_to("pre", src, [0, 1], "first", epoch=epoch)
        for layer in range(L):
            first.save_layer(layer)
        first.finish(b"")
        first.wait_for_save(WAIT)
        epoch = pair.far.call("expect", "dec", "unanswered", [2, 3])
        pair.far.pause()
        try:
            stream = pair.dec.stream_to("pre", src, [2, 3], "unanswered", epoch=epoch)
            for layer in range(L):   # held here until a Go
                stream.save_layer(layer)
            stream.finish(b"")
            with pytest.raises(TimeoutError, match=r"no answer to the Begin of .*'unanswered'.*"
                               r"\(nothing was written; the Begin was sent\)"):
                stream.wait_for_save(WAIT)
            assert stream.state == StreamState.FAILED
        finally:
            pair.far.resume()
        pair.cache.pool.free(src)
    finally:
        pair.close()


def _final_without_ack(pair: Pair) -> None:
    epoch = pair.far.call("expect", "dec", "acked", [0, 1])
    src = pair.cache.pool.allocate(2)
    stream = pair.dec.stream_to("pre", src, [0, 1], "acked", epoch=epoch)
    for layer in range(L):
        stream.save_layer(layer)
    pair.far.call("wait_for_layer", "acked", L - 1, WAIT)
    pair.far.pause()
    try:
        stream.finish(b"tok")
        with pytest.raises(TimeoutError, match="no acknowledgement of the Final"):
            stream.wait_for_save(WAIT)
        assert stream.state == StreamState.FAILED
        assert pair.dec.stats().acks_missed == 1
    finally:
        pair.far.resume()
    pair.cache.pool.free(src)


# --- checksums and injected faults ------------------------------------------------------------

def test_checksums_pass_for_a_clean_stream(pair):
    load, ids = pair.lease("clean", 3, timeout=WAIT)
    src = pair.sender_blocks(3)
    pair.far.call("stream_to", "dec", src, ids, "clean", load.epoch)
    pair.far.call("write_layers", 7007, list(range(L)), src)
    pair.far.call("save_layers", "clean", list(range(L)))
    pair.far.call("finish", "clean", b"")
    assert load.wait_all(WAIT) == b""
    assert load.bad_blocks() == [] and pair.dec.stats().checksum_mismatches == 0
    pair.cache.pool.free(ids)


def test_a_corrupted_put_is_caught_by_the_checksums_and_never_served():
    """Fault injection flips one byte of every 3rd layer put on its way. The receiver's
    checksums catch it: the load fails with ChecksumError naming the block, bad_blocks() lists
    it, the mismatch is counted; the waits never return the corrupted layer as ready."""
    pair = Pair(sender_kwargs={"faults": "corrupt_every=3", "checksums": True})
    try:
        load, ids = pair.lease("corrupt", 2, timeout=WAIT)
        src = pair.sender_blocks(2)
        pair.far.call("run_stream", "dec", src, ids, "corrupt", load.epoch, list(range(L)), 8008,
                      0.0, b"", WAIT)
        with pytest.raises(ChecksumError, match="does not match the sender's checksums") as ei:
            load.wait_all(WAIT)
        assert str(ids[0]) in str(ei.value)
        assert load.bad_blocks() == [ids[0]]
        assert load.layers_ready()[2] is True and load.state == StreamState.FAILED
        assert pair.dec.stats().checksum_mismatches >= 1
        assert load.wait_released(WAIT)
        pair.cache.pool.free(ids)
    finally:
        pair.close()


@pytest.mark.parametrize("faults", ["fail_post=20", "drop_message=0.05,seed=7",
                                    "delay_message_ms=30", "delay_post_us=20000"])
def test_injected_faults_end_every_stream_cleanly_and_release_every_lease(faults):
    """With faults in the sender's post path, 12 streams either complete with exact bytes or
    end with a clear error; none hangs past its lease, and every lease is released."""
    pair = Pair(sender_kwargs={"faults": faults}, receiver_kwargs={"cancel_timeout": 0.5})
    try:
        outcomes = []
        for i in range(12):
            load, ids = pair.lease(f"f{i}", 2, timeout=1.0)
            src = pair.sender_blocks(2)
            pair.far.call("run_stream", "dec", src, ids, f"f{i}", load.epoch, list(range(L)),
                          9000 + i, 0.0, b"ok", WAIT)
            try:
                assert load.wait_all(WAIT) == b"ok"
                for layer in range(L):
                    np.testing.assert_array_equal(pair.raw[layer, ids],
                                                  layer_data(9000 + i, layer, 2, BLOCK))
                outcomes.append("done")
            except (TransferError, PeerError, TimeoutError) as error:
                outcomes.append(type(error).__name__)
            pair.far.call("join_stream", f"f{i}", WAIT)
            assert load.wait_released(WAIT), f"stream {i}: lease never released"
            pair.cache.pool.free(ids)
            pair.far.call("free", src)
            if "pre" not in pair.dec.peers:  # cut off (a dropped Abort): connect again
                assert pair.far.call("connect", *pair.dec.listen_address) == "dec"
        assert pair.far.call("faults_injected"), "no fault was injected"
        if faults.startswith("delay"):
            assert outcomes == ["done"] * 12, outcomes
        else:
            assert "done" in outcomes and len(set(outcomes)) > 1, outcomes
        _all_released(pair)
    finally:
        pair.close()
