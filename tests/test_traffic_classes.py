"""Traffic classes (issue 31, item 6): a hand-off goes before an offload on the mapped path
(csrc/transport/copier.h) and over UCX (csrc/transport/paced_path.h), without starving it,
and every byte of both lands.
Order, not timing: a hand-off posted behind a large offload completes early in the
offload's time with classes, and at its end without them (the case that shows the classes do
something). What it costs a
hand-off is ``kvmove-bench classes``' business."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvmove
from kvmove.errors import ConfigError

from helpers.kv import make_cache, raw_view

# A block of one layer is 64 KiB, of every layer 512 KiB: the offload's 384 blocks are
# 192 MiB (tens of milliseconds on two copy threads), a hand-off's 4 blocks 2 MiB.
LAYOUT = dict(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
OFFLOAD, HANDOFF = list(range(384)), list(range(384, 388))
WAIT = 30.0
PENDING = kvmove.TransferState.PENDING


@pytest.fixture(params=["mapped", "ucx"])
def trio(request):
    """A sender with two peers, a decode (hand-offs) and a store (offloads), on the mapped
    path (the copier's classes) or over UCX's tcp (paced windows: paced_path.h)."""
    sender_cache = make_cache(LAYOUT, 388)
    raw = raw_view(sender_cache)
    raw[...] = np.random.default_rng(3).integers(0, 256, raw.shape, dtype=np.uint8)
    kwargs = {} if request.param == "mapped" else {"same_host": "ucx", "transports": "tcp"}
    with kvmove.Agent("sender", sender_cache, **kwargs) as sender, \
            kvmove.Agent("decode", make_cache(LAYOUT, 128), **kwargs) as decode, \
            kvmove.Agent("store", make_cache(LAYOUT, 384), **kwargs) as store:
        for peer in (decode, store):
            sender.add_peer(peer.metadata())
            peer.add_peer(sender.metadata())
            assert sender.peer_path(peer.name) == request.param
        yield sender, decode, store


def _handoff_share(sender, offload_class: str, handoff: int = len(HANDOFF)) -> float:
    """When a hand-off of ``handoff`` blocks posted right behind a large offload completed,
    as a share of the time the offload took: near 1 when it waited its turn, near 0 when it
    went first (by when each was posted plus its time to completion, which a slow machine
    cannot blur as polling could)."""
    sources = HANDOFF if handoff == len(HANDOFF) else OFFLOAD[:handoff]
    offload_posted = time.perf_counter()
    offload = sender.write("store", OFFLOAD, OFFLOAD, traffic=offload_class)
    handoff_posted = time.perf_counter()
    moved = sender.write("decode", sources, list(range(handoff)))
    moved.wait(WAIT)
    offload.wait(WAIT)
    handoff_end = handoff_posted + moved.stats.complete_seconds - offload_posted
    return handoff_end / offload.stats.complete_seconds


MAPPED = pytest.mark.parametrize("trio", ["mapped"], indirect=True)
UCX = pytest.mark.parametrize("trio", ["ucx"], indirect=True)


@MAPPED
def test_a_handoff_posted_behind_an_offload_lands_first_with_classes(trio) -> None:
    sender, decode, store = trio
    assert _handoff_share(sender, "offload") < 0.5
    sent = raw_view(sender.cache)
    assert np.array_equal(raw_view(decode.cache)[:, :4], sent[:, HANDOFF])
    assert np.array_equal(raw_view(store.cache), sent[:, OFFLOAD])


@MAPPED
def test_without_classes_the_handoff_waits_for_the_offload(trio) -> None:
    """The copier's queue without classes is FIFO. (Over UCX endpoints share the link, so a
    hand-off never waits for a whole offload: the next test shows pacing there.)"""
    sender, _, _ = trio
    assert _handoff_share(sender, "handoff") > 0.5


@UCX
def test_an_offload_waits_for_the_handoffs_in_flight(trio) -> None:
    """Paced over UCX: an offload posted while a hand-off is in flight lands after it, every
    time (unpaced, the two land together, either first). A 4 MiB hand-off takes a few ms,
    far below the 20 ms after which a waiting offload gets a window anyway."""
    sender, decode, store = trio
    for _ in range(3):
        handoff_posted = time.perf_counter()
        handoff = sender.write("decode", OFFLOAD[:8], list(range(8)))
        offload_posted = time.perf_counter()
        offload = sender.write("store", OFFLOAD[:4], OFFLOAD[:4], traffic="offload")
        handoff.wait(WAIT)
        offload.wait(WAIT)
        handoff_end = handoff_posted + handoff.stats.complete_seconds
        assert offload_posted + offload.stats.complete_seconds > handoff_end
    sent = raw_view(sender.cache)
    assert np.array_equal(raw_view(decode.cache)[:, :8], sent[:, :8])
    assert np.array_equal(raw_view(store.cache)[:, :4], sent[:, :4])


def test_an_offload_still_moves_while_handoffs_keep_coming(trio) -> None:
    sender, decode, store = trio
    offload = sender.write("store", OFFLOAD, OFFLOAD, traffic="offload")
    handoffs = 0  # it moves by a chunk or window (1 MiB) each 20 ms at least: 192 MiB in 4 s
    deadline = time.monotonic() + WAIT
    while offload.state == PENDING and time.monotonic() < deadline:
        sender.write("decode", HANDOFF, [0, 1, 2, 3]).wait(WAIT)
        handoffs += 1
    offload.wait(WAIT)  # raises TimeoutError when starved
    assert np.array_equal(raw_view(store.cache), raw_view(sender.cache)[:, OFFLOAD])
    assert handoffs > 0


@pytest.mark.parametrize("method", ["write", "read"])
def test_each_class_moves_every_byte_both_ways(trio, method) -> None:
    sender, _, store = trio
    for traffic in kvmove.TRAFFIC_CLASSES:
        raw_view(store.cache)[...] = 0 if method == "write" else 9
        getattr(sender, method)("store", [0, 1], [5, 6], traffic=traffic).wait(WAIT)
        here, there = raw_view(sender.cache)[:, [0, 1]], raw_view(store.cache)[:, [5, 6]]
        assert np.array_equal(here, there)


def test_an_unknown_class_is_refused_naming_the_classes(trio) -> None:
    sender, _, _ = trio
    with pytest.raises(ConfigError, match=r"traffic must be one of \('handoff', 'prefetch', "
                                          r"'offload'\), got 'bulk'"):
        sender.write("store", [0], [0], traffic="bulk")


@pytest.mark.parametrize("path", ["mapped", "ucx"])
def test_an_offload_waits_while_a_stream_waits_for_its_receivers_go(path) -> None:
    """A hand-off is under way before its first copy: its stream waits for the receiver's Go
    (here 300 ms late: the decode's messages are delayed). An offload posted meanwhile gets
    one 1 MiB chunk or window per 20 ms until the Go comes, then moves at full speed (unheld,
    64 MiB take tens of ms)."""
    sender_cache = make_cache(LAYOUT, 388)
    raw = raw_view(sender_cache)
    raw[...] = np.random.default_rng(4).integers(0, 256, raw.shape, dtype=np.uint8)
    kwargs = {} if path == "mapped" else {"same_host": "ucx", "transports": "tcp"}
    with kvmove.Agent("sender", sender_cache, **kwargs) as sender, \
            kvmove.Agent("decode", make_cache(LAYOUT, 128), faults="delay_message_ms=300",
                         **kwargs) as decode, \
            kvmove.Agent("store", make_cache(LAYOUT, 384), **kwargs) as store:
        for peer in (decode, store):
            sender.add_peer(peer.metadata())
            peer.add_peer(sender.metadata())
            assert sender.peer_path(peer.name) == path
        load = decode.expect("sender", "r1", [0, 1, 2, 3], timeout=WAIT).start_load()
        stream = sender.stream_to("decode", HANDOFF, [0, 1, 2, 3], "r1", epoch=load.epoch)
        offload = sender.write("store", OFFLOAD[:128], OFFLOAD[:128], traffic="offload")
        time.sleep(0.15)   # the Go is 300 ms away: at most ~8 of the offload's 64 MiB moved
        assert offload.state == PENDING, "the offload did not wait for the hand-off's Go"
        for layer in range(LAYOUT["num_layers"]):
            stream.save_layer(layer)
        stream.finish()
        load.wait_all(WAIT)
        stream.wait_for_save(WAIT)
        offload.wait(WAIT)
        assert np.array_equal(raw_view(decode.cache)[:, :4], raw[:, HANDOFF])
        assert np.array_equal(raw_view(store.cache)[:, :128], raw[:, :128])
