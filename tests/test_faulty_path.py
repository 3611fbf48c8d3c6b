"""Fault injection wraps any path (``csrc/transport/faulty_path.h``): each fault does what it
says over both of a peer's paths, the mapped one (same host: copies into its memory) and UCX
(tcp here), and never touches the sender's own memory.

Two agents in this process (``helpers.stream_pair.Pair``): "a" injects faults and sends, "b"
receives. ``same_host="ucx"`` on the sender keeps UCX for its bytes; the default maps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmove.errors import ChecksumError, PeerError, TransferError

from helpers.serve import wait_until
from helpers.stream_pair import PL, WAIT, Pair

PATHS = {"mapped": {}, "ucx": {"same_host": "ucx"}}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> str:
    return request.param


def pair_with(path: str, faults: str, **a_kwargs: object) -> Pair:
    pair = Pair(a_kwargs={"faults": faults, **PATHS[path], **a_kwargs})
    assert pair.a.peer_path("b") == path
    return pair


@pytest.fixture
def closing() -> Iterator[list[Pair]]:
    pairs: list[Pair] = []
    yield pairs
    for p in pairs:
        p.close()


def test_fail_post_fails_the_transfer_and_writes_nothing(path, closing):
    pair = pair_with(path, "fail_post=1")
    closing.append(pair)
    transfer = pair.a.write("b", [1, 2], [3, 4], notify=b"never")
    with pytest.raises(TransferError, match="injected fault"):
        transfer.wait(WAIT)
    assert pair.a.faults_injected() == {"fail_post": 1}
    pair.assert_caches()
    assert pair.b.notifications() == []


def test_a_clean_stream_passes_its_checksums(path, closing):
    """The same checksums whoever computes them: the mapped path's copy threads hash each
    block as they copy it, a UCX path's sender before it posts; the receiver verifies both."""
    pair = pair_with(path, "")
    closing.append(pair)
    assert pair.a.checksums  # the default
    for rid in ("r1", "r2"):
        pair.complete(*pair.start(rid))
    assert pair.b.stats().checksum_mismatches == 0


def test_a_corrupted_layer_is_caught_and_the_senders_blocks_stay_intact(path, closing):
    """Every layer put lands with its first byte flipped: the checksums (on by default) catch
    it (the first destination block is named bad), and the sender's own bytes never changed."""
    pair = pair_with(path, "corrupt_every=1")  # checksums: on by default
    assert pair.a.checksums
    closing.append(pair)
    stream, load = pair.start("r")
    for i in range(PL):
        stream.save_layer(i)
    stream.finish(b"")
    with pytest.raises(ChecksumError, match="does not match the sender's checksums"):
        load.wait_all(WAIT)
    assert load.bad_blocks() == [4]
    # The load failed at the first bad layer, and its Cancel may stop the layers after it:
    # each layer either never landed (still zero) or landed with exactly its first byte flipped.
    landed = [i for i in range(PL) if pair.b_raw[i, [4, 5, 6]].any()]
    assert landed and 1 <= pair.a.faults_injected()["corrupt"] <= PL
    assert (pair.a_raw == pair.a_ref).all(), "the sender's memory was written"
    got, want = pair.b_raw[landed][:, [4, 5, 6]], pair.a_ref[landed][:, [1, 2, 3]]
    assert (got[:, 0, 0] == want[:, 0, 0] ^ 0xFF).all()
    assert (got[:, 0, 1:] == want[:, 0, 1:]).all() and (got[:, 1:] == want[:, 1:]).all()
    assert load.wait_released(WAIT)


def test_a_dropped_message_is_reported_sent_and_never_arrives(path, closing):
    pair = pair_with(path, "drop_message=1")
    closing.append(pair)
    pair.a.write("b", [1], [2], notify=b"lost").wait(WAIT)
    pair.landed([1], [2])
    pair.assert_caches()
    time.sleep(0.2)
    assert pair.b.notifications() == []
    assert pair.a.faults_injected()["drop_message"] == 1


def test_delayed_messages_arrive_late_and_in_order(path, closing):
    pair = pair_with(path, "delay_message_ms=300")
    closing.append(pair)
    start = time.monotonic()
    pair.a.write("b", [1], [2], notify=b"first").wait(WAIT)
    pair.a.send("b", b"second").wait(WAIT)
    got = [pair.b.wait_notification(WAIT) for _ in range(2)]
    assert time.monotonic() - start >= 0.3
    assert got == [("a", b"first"), ("a", b"second")]
    pair.landed([1], [2])
    pair.assert_caches()


def test_rendezvous_messages_are_dropped_by_the_receiver(path, closing):
    pair = pair_with(path, "rndv_messages=1")
    closing.append(pair)
    pair.a.send("b", b"x" * 100).wait(WAIT)
    wait_until(lambda: pair.b.stats().messages_dropped == 1, WAIT, "the receiver's drop")
    assert pair.b.notifications() == []


def test_a_held_message_of_a_removed_peer_fails_its_transfer(path, closing):
    """The connection closes while a fault holds a notification back: its transfer fails
    (it will never be sent) rather than hang."""
    pair = pair_with(path, "delay_message_ms=5000")
    closing.append(pair)
    transfer = pair.a.send("b", b"held")
    pair.a.remove_peer("b")
    with pytest.raises(PeerError, match="removed"):
        transfer.wait(WAIT)
