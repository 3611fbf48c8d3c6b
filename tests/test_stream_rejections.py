"""Layer streams' rejection paths (``kvmove/stream.py``, ``csrc/stream/``), with two agents in
this process (``helpers.stream_pair.Pair``): each test checks the exception class, that the
message names the offending value, and that nothing changed (the same stream, or a new one,
still completes and lands exactly). The two-process streaming tests are
``test_layer_stream.py``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvmove
from kvmove import StreamState
from kvmove.errors import (
    BlockError,
    ConfigError,
    CudaError,
    KVMoveError,
    PeerError,
    TimeoutError,
    TransferError,
)

from helpers.checks import Background, names, within
from helpers.kv import make_cache, raw_view
from helpers.serve import wait_until
from helpers.stream_pair import A_BLOCKS, B_BLOCKS, LAYOUT, PL, TCP, WAIT, Pair

LONG = 30.0    # deadline of waits that must be ended early by something else
PROMPT = 5.0   # "promptly": a close must end such a wait within this


@pytest.fixture
def pair() -> Iterator[Pair]:
    with Pair() as p:
        yield p


# -- stream_to ---------------------------------------------------------------------------------

@pytest.mark.parametrize("local, remote", [([1, 2], [1]), ([1], [1, 2]), ([], [1])])
def test_reject_stream_to_with_length_mismatch(pair, local, remote):
    with pytest.raises(ConfigError, match="cannot pair") as excinfo:
        pair.a.stream_to("b", local, remote, "r", epoch=pair.epoch())
    names(excinfo, f"{len(local)} local blocks", f"{len(remote)} remote blocks", "'b'")
    pair.assert_usable("r")  # the request id was not taken


@pytest.mark.parametrize("bad", [A_BLOCKS, -1, 2**40])
def test_reject_stream_to_with_local_id_out_of_range(pair, bad):
    with pytest.raises(BlockError, match="local block") as excinfo:
        pair.a.stream_to("b", [0, bad], [0, 1], "r", epoch=pair.epoch())
    names(excinfo, bad, f"[0, {A_BLOCKS})")
    pair.assert_usable("r")


@pytest.mark.parametrize("bad", [B_BLOCKS, -1])
def test_reject_stream_to_with_remote_id_out_of_range(pair, bad):
    with pytest.raises(BlockError) as excinfo:
        pair.a.stream_to("b", [0, 1], [0, bad], "r", epoch=pair.epoch())
    names(excinfo, f"block {bad} of 'b'", f"[0, {B_BLOCKS})")
    pair.assert_usable("r")


def test_reject_stream_to_with_duplicate_destination(pair):
    with pytest.raises(BlockError, match="appears twice") as excinfo:
        pair.a.stream_to("b", [1, 2, 3], [4, 9, 4], "r", epoch=pair.epoch())
    names(excinfo, "destination block 4")
    pair.assert_usable("r")


def test_stream_to_with_duplicate_sources_is_allowed(pair):
    """Two destinations may be filled from one source block (no race: nothing is written
    twice)."""
    stream, load = pair.start("dup", [5, 5, 2], [0, 1, 2])
    pair.complete(stream, load, src=[5, 5, 2])


def test_reject_stream_to_unknown_peer(pair):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.a.stream_to("nobody", [1], [1], "r", epoch=pair.epoch())
    names(excinfo, "'nobody'", "'a'")
    pair.assert_usable("r")


def test_reject_stream_to_and_expect_of_a_removed_peer(pair):
    pair.a.remove_peer("b")
    pair.b.remove_peer("a")
    with pytest.raises(PeerError, match="unknown peer 'b'"):
        pair.a.stream_to("b", [1], [1], "r", epoch=pair.epoch())
    with pytest.raises(PeerError, match="unknown peer 'a'"):
        pair.b.expect("a", "r", [1])
    assert pair.a.add_peer(pair.b.metadata()) == "b"
    assert pair.b.add_peer(pair.a.metadata()) == "a"
    pair.assert_usable("r")


@pytest.mark.parametrize("rid, nbytes", [("", 0), ("x" * 257, 257), ("é" * 129, 258)],
                         ids=["empty", "257-ascii", "129-chars-258-bytes"])
def test_reject_bad_request_id(pair, rid, nbytes):
    """The limit is 1..256 bytes (UTF-8), on both sides."""
    with pytest.raises(ConfigError, match="request_id") as excinfo:
        pair.a.stream_to("b", [1], [1], rid, epoch=pair.epoch())
    names(excinfo, "1..256 bytes", f"got {nbytes}")
    with pytest.raises(ConfigError, match="request_id") as excinfo:
        pair.b.expect("a", rid, [1])
    names(excinfo, "1..256 bytes", f"got {nbytes}")
    pair.assert_usable()


def test_request_id_of_exactly_256_bytes_is_streamed(pair):
    rid = "é" * 128  # 256 bytes
    stream, load = pair.start(rid)
    assert stream.request_id == rid and load.request_id == rid
    pair.complete(stream, load)


def test_reject_a_second_stream_of_the_same_lease(pair):
    """One stream per lease, while it runs: a second stream_to with its epoch is refused
    before anything moves; the first completes; the same request id streams to another peer
    meanwhile (its own lease there), and to "b" again under a new lease after."""
    stream, load = pair.start("r")
    stream.save_layer(0)
    with pytest.raises(ConfigError, match="already being streamed") as excinfo:
        pair.a.stream_to("b", [7], [9], "r", epoch=load.epoch)
    names(excinfo, load.epoch, "'b'")
    with kvmove.Agent("c", make_cache(LAYOUT, 4), **TCP) as c:
        pair.a.add_peer(c.metadata())
        c.add_peer(pair.a.metadata())
        other = c.expect("a", "r", [0]).start_load()
        to_c = pair.a.stream_to("c", [7], [0], "r", epoch=other.epoch)
        for i in range(PL):
            to_c.save_layer(i)
        to_c.wait_for_save(WAIT)
        assert other.wait_all(WAIT) == b""
        np.testing.assert_array_equal(raw_view(c.cache)[:, 0], pair.a_ref[:, 7])
        pair.a.remove_peer("c")
    pair.complete(stream, load, saved=(0,))
    pair.complete(*pair.start("r", [9], [10]), src=[9])


@pytest.mark.parametrize("field", ["num_layers", "head_dim"])
def test_reject_streams_between_different_layouts(pair, field):
    with kvmove.Agent("odd", make_cache({**LAYOUT, field: LAYOUT[field] * 2}, 4), **TCP) as odd:
        pair.a.add_peer(odd.metadata())
        odd.add_peer(pair.a.metadata())
        with pytest.raises(ConfigError, match="KV layouts differ") as excinfo:
            pair.a.stream_to("odd", [1], [1], "r", epoch=pair.epoch())
        names(excinfo, "'odd'")
        with pytest.raises(ConfigError, match="KV layouts differ") as excinfo:
            odd.expect("a", "r", [1])
        names(excinfo, "'a'")
        pair.a.remove_peer("odd")
    pair.assert_usable("r")


def test_reject_stream_to_and_expect_on_a_closed_agent(pair):
    pair.a.close()
    with pytest.raises(ConfigError, match="closed") as excinfo:
        pair.a.stream_to("b", [1], [1], "r", epoch=pair.epoch())
    names(excinfo, "'a'")
    pair.b.close()
    with pytest.raises(ConfigError, match="closed") as excinfo:
        pair.b.expect("a", "r", [1])
    names(excinfo, "'b'")


# -- save_layer --------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [PL, -1, 2**31, -2**40])
def test_reject_save_layer_out_of_range(pair, layer):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="out of range") as excinfo:
        stream.save_layer(layer)
    names(excinfo, f"layer {layer}", f"[0, {PL})")
    assert stream.layer_times() == [(None, None)] * PL  # nothing was posted
    pair.complete(stream, load)


def test_reject_saving_a_layer_twice(pair):
    stream, load = pair.start("r")
    stream.save_layer(3)
    with pytest.raises(ConfigError, match="already saved") as excinfo:
        stream.save_layer(3)
    names(excinfo, "layer 3", "'r'", "'b'")
    pair.complete(stream, load, saved=(3,))


def test_layers_may_be_saved_in_any_order(pair):
    stream, load = pair.start("r")
    for i in [5, 0, 11, 3, 1, 10, 2, 9, 4, 8, 6, 7]:
        stream.save_layer(i)
    pair.complete(stream, load, saved=tuple(range(PL)))


@pytest.mark.skipif(kvmove.cuda_status().built, reason="a CUDA build accepts CUDA events")
@pytest.mark.parametrize("event", [1, 0xDEAD, "object"], ids=["int", "handle", "object"])
def test_reject_a_cuda_event_in_a_build_without_cuda(pair, event):
    class Event:
        cuda_event = 0xBEEF

    stream, load = pair.start("r")
    with pytest.raises(CudaError, match="without CUDA") as excinfo:
        stream.save_layer(2, event=Event() if event == "object" else event)
    names(excinfo, hex(0xBEEF if event == "object" else event))
    pair.complete(stream, load)  # layer 2 was not marked saved


@pytest.mark.parametrize("event, shown", [("x", "got str"), (1.5, "got float"),
                                          (True, "got bool"), (b"\x01", "got bytes"),
                                          (0, "got 0"), (-3, "got -3")])
def test_reject_bad_event(pair, event, shown):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="event") as excinfo:
        stream.save_layer(0, event=event)
    names(excinfo, shown)
    pair.complete(stream, load)


def test_reject_an_event_handle_too_large_for_a_pointer(pair):
    """2**64 is a positive int but no pointer: like every other bad event, a ConfigError that
    names it (not pybind11's TypeError about incompatible function arguments)."""
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="event") as excinfo:
        stream.save_layer(0, event=2**64)
    names(excinfo, 2**64)
    pair.complete(stream, load)


def test_reject_save_layer_after_finish_and_after_abort(pair):
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    stream.finish(b"p")
    with pytest.raises(ConfigError, match=r"after finish\(\)") as excinfo:
        stream.save_layer(0)
    names(excinfo, "layer 0", "'r'")
    stream.wait_for_save(WAIT)
    with pytest.raises(ConfigError, match=r"after finish\(\)"):
        stream.save_layer(0)  # DONE by now
    assert load.wait_all(WAIT) == b"p"
    pair.landed([1, 2, 3], [4, 5, 6])

    stream, load = pair.start("r2")
    stream.save_layer(0)
    stream.abort(WAIT)
    assert stream.state == StreamState.ABORTED
    with pytest.raises(ConfigError, match=r"after abort\(\)") as excinfo:
        stream.save_layer(1)
    names(excinfo, "layer 1", "'r2'")
    with pytest.raises(TransferError, match="aborted"):
        load.wait_all(WAIT)
    # Layer 0 landed (its checksum check may have been pending when the abort came).
    assert not any(load.layers_ready()[1:])
    pair.landed([1, 2, 3], [4, 5, 6], 0)  # abort() returned: layer 0 had landed
    pair.assert_usable()


# -- finish / wait_for_save / abort ------------------------------------------------------------

def test_reject_finish_with_missing_layers(pair):
    """The message lists the missing layers (the first 8, then "...")."""
    stream, load = pair.start("r")
    stream.save_layer(0)
    stream.save_layer(2)
    with pytest.raises(ConfigError, match="never saved") as excinfo:
        stream.finish(b"p")
    names(excinfo, "'r'", "10 layers were never saved (1, 3, 4, 5, 6, 7, 8, 9, ...)")
    for i in [1, 3, 4, 5, 6, 7, 8, 9, 10]:
        stream.save_layer(i)
    with pytest.raises(ConfigError, match=r"1 layers were never saved \(11\)"):
        stream.wait_for_save(WAIT)  # finish() without payload: rejected the same way
    assert stream.state == StreamState.OPEN
    pair.complete(stream, load, payload=b"p", saved=tuple(range(11)))


def test_reject_payload_over_64_kib(pair):
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    with pytest.raises(ConfigError, match="payload") as excinfo:
        stream.finish(b"x" * (64 * 1024 + 1))
    names(excinfo, 64 * 1024 + 1, 64 * 1024)
    pair.complete(stream, load, payload=bytes(range(256)) * 256,  # exactly 64 KiB
                  saved=tuple(range(PL)))


@pytest.mark.parametrize("payload", ["token", 7, None], ids=["str", "int", "None"])
def test_reject_payload_that_is_not_bytes(pair, payload):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="payload must be bytes") as excinfo:
        stream.finish(payload)
    names(excinfo, type(payload).__name__)
    pair.complete(stream, load)


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_bytes_like_payload_is_delivered(pair, kind):
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    stream.finish(kind(b"tok\x00en"))
    stream.wait_for_save(WAIT)
    assert load.wait_all(WAIT) == b"tok\x00en"


def test_reject_finish_twice_and_finish_after_abort(pair):
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    stream.finish(b"first")
    with pytest.raises(ConfigError, match="already finished") as excinfo:
        stream.finish(b"second")
    names(excinfo, "'r'", "'b'")
    stream.wait_for_save(WAIT)
    assert load.wait_all(WAIT) == b"first"
    pair.landed([1, 2, 3], [4, 5, 6])

    stream, load = pair.start("r2")
    stream.abort(WAIT)
    with pytest.raises(ConfigError, match="already aborted") as excinfo:
        stream.finish(b"p")
    names(excinfo, "'r2'")
    with pytest.raises(TransferError, match="was aborted") as excinfo:
        stream.wait_for_save(WAIT)
    names(excinfo, "'r2'", "'b'")
    pair.assert_usable()


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), 1e7])
def test_reject_bad_wait_for_save_timeout(pair, timeout):
    """A rejected wait_for_save must change nothing: in particular it must not finish the
    stream (with an empty payload) on the way, so finish() still takes the real payload."""
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    with pytest.raises(ConfigError, match="timeout must be in") as excinfo:
        stream.wait_for_save(timeout)
    names(excinfo, "1e+06")
    stream.finish(b"the-token")
    stream.wait_for_save(WAIT)
    assert load.wait_all(WAIT) == b"the-token"


def test_abort_after_the_stream_failed_does_nothing(pair):
    """abort() "does nothing when the stream already ended" (the usual cleanup after any error):
    also when it ended FAILED because its peer went away."""
    stream, load = pair.start("r")
    stream.save_layer(0)
    pair.a.remove_peer("b")
    with pytest.raises(PeerError, match="was removed") as excinfo:
        stream.wait_for_save(WAIT)
    names(excinfo, "'b'")
    assert stream.state == StreamState.FAILED
    stream.abort(WAIT)
    assert stream.state == StreamState.FAILED


def test_abort_after_done_does_nothing(pair):
    stream, load = pair.start("r")
    pair.complete(stream, load)
    stream.abort(WAIT)
    assert stream.state == StreamState.DONE
    assert load.state == StreamState.DONE


def test_abort_right_after_finish_ends_both_sides_the_same_way(pair):
    """A final already on its way is not recalled; one not yet sent is replaced by the abort.
    Either way the two sides agree, and each of the receiver's layers is either untouched or
    whole, whole for every layer it reports ready (with checksums, on by default, a layer that
    landed may have been awaiting its check when the abort ended the load)."""
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    stream.finish(b"p")
    stream.abort(WAIT)
    if stream.state == StreamState.DONE:
        assert load.wait_all(WAIT) == b"p"
    else:
        assert stream.state == StreamState.ABORTED
        with pytest.raises(TransferError, match="aborted"):
            load.wait_all(WAIT)
    assert load.wait_released(WAIT)
    ready = load.layers_ready()
    before = pair.b_ref.copy()
    for i in range(PL):
        whole = np.array_equal(pair.b_raw[i, [4, 5, 6]], pair.a_ref[i, [1, 2, 3]])
        assert whole or np.array_equal(pair.b_raw[i], before[i]), f"layer {i} is torn"
        assert whole or not ready[i], f"layer {i} is reported ready, its bytes are not"
        if whole:
            pair.landed([1, 2, 3], [4, 5, 6], i)
    pair.assert_caches()
    pair.assert_usable()


def test_a_fresh_stream_has_no_layer_times(pair):
    stream, load = pair.start("r")
    assert (stream.peer, stream.request_id, stream.num_layers) == ("b", "r", PL)
    assert (load.peer, load.request_id, load.num_layers, load.local_ids) == ("a", "r", PL,
                                                                              [4, 5, 6])
    assert stream.layer_times() == [(None, None)] * PL
    assert load.layer_times() == [None] * PL
    assert load.layers_ready() == [False] * PL
    assert load.payload == b""
    assert "0/12 layers" in repr(load) and "OPEN" in repr(stream)
    pair.complete(stream, load)


# -- expect / start_load / waits ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [B_BLOCKS, -1])
def test_reject_expect_with_id_out_of_range(pair, bad):
    with pytest.raises(BlockError, match="out of range") as excinfo:
        pair.b.expect("a", "r", [0, bad])
    names(excinfo, f"block {bad}", f"[0, {B_BLOCKS})")
    pair.assert_usable("r")


def test_reject_expect_with_a_block_twice(pair):
    with pytest.raises(BlockError, match="appears twice") as excinfo:
        pair.b.expect("a", "r", [3, 7, 3])
    names(excinfo, "block 3")
    pair.assert_usable("r")


def test_reject_expect_from_unknown_peer(pair):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.b.expect("nobody", "r", [1])
    names(excinfo, "'nobody'", "'b'")
    pair.assert_usable("r")


@pytest.mark.parametrize("wait", ["wait_for_layer", "wait_all"])
def test_reject_waiting_before_start_load(pair, wait):
    load = pair.b.expect("a", "r", [4, 5, 6])
    stream = pair.a.stream_to("b", [1, 2, 3], [4, 5, 6], "r", epoch=load.epoch)
    stream.save_layer(0)
    args = (0, WAIT) if wait == "wait_for_layer" else (WAIT,)
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"call start_load\(\) before waiting") as excinfo:
        getattr(load, wait)(*args)
    assert time.monotonic() - start < 1.0  # refused, not waited for
    names(excinfo, "'r'")
    load.start_load()
    pair.complete(stream, load, saved=(0,))


def test_reject_start_load_twice(pair):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="already called") as excinfo:
        load.start_load()
    names(excinfo, "'r'", "'a'")
    pair.complete(stream, load)


def test_reject_a_second_lease_of_the_same_request(pair):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="already has lease") as excinfo:
        pair.b.expect("a", "r", [7, 8, 9])
    names(excinfo, "'r'", "'a'", load.epoch)
    pair.complete(stream, load)


@pytest.mark.parametrize("layer", [PL, -1])
def test_reject_wait_for_layer_out_of_range(pair, layer):
    stream, load = pair.start("r")
    with pytest.raises(ConfigError, match="out of range") as excinfo:
        load.wait_for_layer(layer, WAIT)
    names(excinfo, f"layer {layer}", f"[0, {PL})")
    pair.complete(stream, load)


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf")])
def test_reject_bad_load_wait_timeout(pair, timeout):
    stream, load = pair.start("r")
    for wait, args in ((load.wait_for_layer, (0, timeout)), (load.wait_all, (timeout,))):
        with pytest.raises(ConfigError, match="timeout must be in") as excinfo:
            wait(*args)
        names(excinfo, "1e+06")
    pair.complete(stream, load)


def test_load_waits_time_out_and_the_load_goes_on(pair):
    stream, load = pair.start("r")
    stream.save_layer(0)
    load.wait_for_layer(0, WAIT)
    with pytest.raises(TimeoutError) as excinfo:
        load.wait_for_layer(4, 0.05)
    names(excinfo, "layer 4", "'r'", "'a'", "0.05 s", f"1 of {PL} layers")
    with pytest.raises(TimeoutError) as excinfo:
        load.wait_all(0.05)
    names(excinfo, "'r'", f"1 of {PL} layers in")
    assert load.state == StreamState.OPEN
    pair.complete(stream, load, saved=(0,))


def test_cancel_wakes_waiters_and_refuses_start_load(pair):
    stream, load = pair.start("r")
    stream.save_layer(0)  # the lease is engaged (a Cancel before the Begin is a Refuse)
    load.wait_for_layer(0, WAIT)
    pair.landed([1, 2, 3], [4, 5, 6], layers=0)
    waiter = Background(load.wait_for_layer, 1, LONG)
    assert waiter.pending()
    start = time.monotonic()
    load.cancel()
    waiter.join(LONG)
    with pytest.raises(TransferError, match="cancelled by the receiver") as excinfo:
        waiter.get()
    names(excinfo, "'r'")
    assert waiter.ended_at - start < PROMPT
    assert load.state == StreamState.FAILED
    with pytest.raises(ConfigError, match="already called"):
        load.start_load()
    unstarted = pair.b.expect("a", "r-other", [0])
    unstarted.cancel()
    assert unstarted.released  # no sender engaged it: released at once
    with pytest.raises(ConfigError, match="after it failed") as excinfo:
        unstarted.start_load()
    names(excinfo, "'r-other'", "cancelled")
    # The sender was told: it stops, and the blocks are released once it answered.
    wait_until(lambda: stream.state != StreamState.OPEN, WAIT, "the sender never heard")
    with pytest.raises(TransferError, match="cancelled by its receiver"):
        stream.wait_for_save(WAIT)
    assert stream.state == StreamState.ABORTED
    assert load.wait_released(WAIT)
    pair.assert_usable()


def test_closing_the_receiver_wakes_its_waiters(pair):
    """layer_stream.h: the agent closing wakes every waiter with an exception."""
    stream, load = pair.start("r")
    waiter = Background(load.wait_all, LONG)
    assert waiter.pending()
    start = time.monotonic()
    within(15, pair.b.close)
    waiter.join(LONG)
    with pytest.raises(TransferError, match="closed"):
        waiter.get()
    assert waiter.ended_at - start < PROMPT
    assert load.state == StreamState.FAILED


def test_closing_the_sender_fails_its_open_streams(pair):
    stream, load = pair.start("r")
    stream.save_layer(0)
    within(15, pair.a.close)
    assert stream.state == StreamState.FAILED
    with pytest.raises(ConfigError, match="closed"):
        stream.save_layer(1)
    with pytest.raises(KVMoveError, match="closed"):
        within(WAIT, stream.wait_for_save, WAIT)


def test_dropped_streams_are_aborted_and_cancelled(pair):
    """Test 11, in this process: a SaveStream dropped while open (del + gc.collect()) is
    aborted, so the load's wait raises TransferError; a LoadStream dropped while open is
    cancelled, so its request can be loaded again."""
    stream, load = pair.start("r")
    stream.save_layer(0)
    del stream
    gc.collect()
    with pytest.raises(TransferError, match="aborted by its sender 'a'"):
        load.wait_all(WAIT)
    # Layer 0 landed (its checksum check may have been pending when the abort came).
    assert not any(load.layers_ready()[1:])
    pair.landed([1, 2, 3], [4, 5, 6], 0)

    dropped = pair.b.expect("a", "r2", [4, 5, 6]).start_load()
    del dropped
    gc.collect()
    load = pair.b.expect("a", "r2", [4, 5, 6]).start_load()  # not "already being loaded"
    pair.complete(pair.a.stream_to("b", [1, 2, 3], [4, 5, 6], "r2", epoch=load.epoch), load)


# -- a request id used again -------------------------------------------------------------------

def test_a_reused_request_id_gets_only_the_new_streams_bytes(pair):
    """Test 9, reuse after a cancelled lease. The receiver leased blocks for "r" and cancelled
    the lease before any sender began (released at once); it leases the same blocks for "r"
    again. The old request's sender runs late with the old lease's epoch: it is refused and
    writes nothing. The new stream fills the blocks: the receiver sees only its layers and
    its payload."""
    dst = [4, 5, 6]
    first = pair.b.expect("a", "r", dst).start_load()
    first.cancel()
    assert first.released
    load = pair.b.expect("a", "r", dst).start_load()
    assert load.epoch != first.epoch

    old = pair.a.stream_to("b", [1, 2, 3], dst, "r", epoch=first.epoch)
    with pytest.raises(TransferError, match="refused") as excinfo:
        for i in range(PL):  # the Refuse may arrive while layers are still being saved
            old.save_layer(i)
        old.wait_for_save(WAIT)
    names(excinfo, "'r'", "nothing was written")
    pair.assert_caches()  # not one byte of b changed
    assert load.layers_ready() == [False] * PL and load.state == StreamState.OPEN

    new = pair.a.stream_to("b", [7, 8, 9], dst, "r", epoch=load.epoch)
    pair.complete(new, load, src=[7, 8, 9], payload=b"new")

