"""The hand-off's first message (``Agent.offer`` / ``offers`` / ``wait_offer`` / ``decline``,
``csrc/stream/offer_box.h``): the receiver leases its blocks and offers the lease to its
sender, which streams into it or declines it; and ``Agent.send``, a notification alone.

Two agents in this process (``helpers.stream_pair.Pair``): "b" (the decode side) offers, "a"
(the prefill side) takes the offers. Every rejection has its own test, which checks the
exception, that the message names the value, and that the pair still works.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

import kvmove
from kvmove import _C, StreamState
from kvmove.errors import BlockError, ConfigError, PeerError, TimeoutError, TransferError

from helpers.checks import names
from helpers.serve import wait_until
from helpers.stream_pair import B_BLOCKS, WAIT, Pair


@pytest.fixture
def pair() -> Iterator[Pair]:
    with Pair() as p:
        yield p


def offer(pair: Pair, rid: str = "r", dst: Sequence[int] = (4, 5, 6)
          ) -> tuple[kvmove.LoadStream, kvmove.Offer]:
    """b leases ``dst`` for ``rid`` and offers it; a takes the offer."""
    load = pair.b.offer("a", rid, dst, timeout=WAIT)
    return load, pair.a.wait_offer(WAIT)


# -- the hand-off ---------------------------------------------------------------------------

def test_an_offer_carries_the_lease_and_is_streamed_into(pair):
    load, got = offer(pair)
    assert got == kvmove.Offer("b", "r", load.epoch, (4, 5, 6))
    assert load.state == StreamState.OPEN and not load.released
    stream = pair.a.stream_to(got.peer, [1, 2, 3], got.blocks, got.request_id, epoch=got.epoch)
    pair.complete(stream, load)
    assert load.released


def test_offers_arrive_in_order_and_are_drained(pair):
    loads = [pair.b.offer("a", f"r{i}", [i], timeout=WAIT) for i in range(3)]
    got: list[kvmove.Offer] = []
    wait_until(lambda: got.extend(pair.a.offers()) or len(got) == 3, WAIT,
               lambda: f"{len(got)} of 3 offers arrived")
    assert [(o.request_id, o.epoch, o.blocks) for o in got] == [
        (f"r{i}", load.epoch, (i,)) for i, load in enumerate(loads)]
    assert pair.a.offers() == []
    for load in loads:
        load.cancel()


def test_an_empty_offer_says_no_kv_is_needed(pair):
    assert pair.b.offer("a", "r", [], timeout=WAIT) is None
    assert pair.a.wait_offer(WAIT) == kvmove.Offer("b", "r", 0, ())
    assert pair.b.stats().leases_granted == 0
    pair.assert_usable()


def test_a_declined_offer_fails_the_load_at_once_and_frees_its_blocks(pair):
    load, got = offer(pair)
    pair.a.decline(got, "the prefill no longer holds it")
    with pytest.raises(TransferError, match="declined by its sender") as excinfo:
        load.wait_all(WAIT)
    names(excinfo, "'r'", "'a'", "the prefill no longer holds it")
    assert load.released and load.state == StreamState.FAILED
    assert pair.b.stats().leases_active == 0
    pair.assert_caches()  # nothing was written
    pair.assert_usable("r")  # the request may be offered again


def test_wait_offer_times_out(pair):
    with pytest.raises(TimeoutError, match="no offer") as excinfo:
        pair.a.wait_offer(0.05)
    names(excinfo, "'a'", "0.05")


def test_an_offer_from_a_removed_peer_is_forgotten(pair):
    load = pair.b.offer("a", "r", [4], timeout=WAIT)
    pair.b.send("a", b"after the offer").wait(WAIT)
    assert pair.a.wait_notification(WAIT) == ("b", b"after the offer")  # the offer is in
    pair.a.remove_peer("b")
    assert pair.a.offers() == []
    load.cancel()


def test_a_peers_waiting_offers_are_capped(pair):
    """1,024 offers of one peer wait at most; more are dropped and counted."""
    loads = [pair.b.offer("a", f"r{i}", [i % B_BLOCKS], timeout=WAIT) for i in range(1030)]
    wait_until(lambda: pair.a.stats().messages_refused >= 6, WAIT,
               lambda: f"{pair.a.stats().messages_refused} of 6 offers dropped")
    assert len(pair.a.offers()) == 1024
    assert pair.a.stats().messages_refused == 6
    for load in loads:
        load.cancel()


# -- forged offers --------------------------------------------------------------------------

def raw_offer(epoch: int, blocks: list[int], ids_hash: int | None = None) -> bytes:
    return _C.encode_stream_message("Offer", "forged", epoch,
                                    ids_hash=_C.hash_ids(blocks) if ids_hash is None
                                    else ids_hash, block_ids=blocks)


@pytest.mark.parametrize("case", ["other run's epoch", "ids hash", "empty with an epoch"])
def test_an_offer_that_cannot_be_the_peers_is_dropped(pair, case):
    """An offer is kept only if it can be what it says: a lease epoch of the peer's own run,
    the ids it hashed, and no epoch without blocks."""
    mine = pair.b.incarnation << 32 | 7
    message = {"other run's epoch": raw_offer((pair.b.incarnation ^ 1) << 32 | 7, [4]),
               "ids hash": raw_offer(mine, [4], ids_hash=12345),
               "empty with an epoch": raw_offer(mine, [])}[case]
    pair.b._core._send_raw_stream_message("a", message)
    pair.b._core._send_raw_stream_message("a", raw_offer(mine, [5]))  # a valid one after it
    assert pair.a.wait_offer(WAIT) == kvmove.Offer("b", "forged", mine, (5,))
    assert pair.a.offers() == []
    assert pair.a.stats().messages_refused == 1


def test_a_decline_of_a_lease_that_was_begun_is_refused_by_the_receiver(pair):
    """Once its sender said Begin, only an Abort ends a lease (its puts may be in flight): a
    Decline then is refused and changes nothing."""
    load, got = offer(pair)
    stream = pair.a.stream_to("b", [1, 2, 3], got.blocks, "r", epoch=got.epoch)
    wait_until(lambda: stream._core.answered, WAIT, "the Go")
    raw = _C.encode_stream_message("Decline", "r", got.epoch, ids_hash=_C.hash_ids([4, 5, 6]),
                                   payload=b"late")
    pair.a._core._send_raw_stream_message("b", raw)
    wait_until(lambda: pair.b.stats().messages_refused == 1, WAIT, "the Decline refused")
    assert load.state == StreamState.OPEN
    pair.complete(stream, load)


# -- rejections -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [B_BLOCKS, -1])
def test_reject_an_offer_of_a_block_out_of_range(pair, bad):
    with pytest.raises(BlockError, match="out of range") as excinfo:
        pair.b.offer("a", "r", [1, bad])
    names(excinfo, bad)
    assert pair.b.stats().leases_granted == 0
    pair.assert_usable("r")


def test_reject_an_offer_of_a_block_twice(pair):
    with pytest.raises(BlockError, match="appears twice") as excinfo:
        pair.b.offer("a", "r", [3, 3])
    names(excinfo, 3)
    pair.assert_usable("r")


def test_reject_an_offer_to_an_unknown_peer(pair):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.b.offer("nobody", "r", [1])
    names(excinfo, "'nobody'")
    with pytest.raises(PeerError, match="no live peer"):
        pair.b.offer("nobody", "r", [])
    pair.assert_usable("r")


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan")])
def test_reject_a_bad_offer_timeout(pair, timeout):
    with pytest.raises(ConfigError, match="timeout"):
        pair.b.offer("a", "r", [1], timeout=timeout)
    with pytest.raises(ConfigError, match="timeout"):
        pair.a.wait_offer(timeout)


def test_reject_a_second_offer_of_the_same_request(pair):
    load, _ = offer(pair)
    with pytest.raises(ConfigError, match="already has lease") as excinfo:
        pair.b.offer("a", "r", [7])
    names(excinfo, "'r'", load.epoch)
    load.cancel()


def test_reject_declining_an_empty_offer(pair):
    pair.b.offer("a", "r", [])
    got = pair.a.wait_offer(WAIT)
    with pytest.raises(ConfigError, match="no lease to decline") as excinfo:
        pair.a.decline(got, "why")
    names(excinfo, "'r'")


def test_reject_a_decline_reason_over_64_kib(pair):
    load, got = offer(pair)
    with pytest.raises(ConfigError, match="65537 bytes exceeds the limit of 65536"):
        pair.a.decline(got, "x" * (64 * 1024 + 1))
    assert load.state == StreamState.OPEN
    pair.a.decline(got, "x" * 64 * 1024)
    with pytest.raises(TransferError, match="declined"):
        load.wait_all(WAIT)


def test_reject_declining_a_lease_being_streamed_into(pair):
    load, got = offer(pair)
    stream = pair.a.stream_to("b", [1, 2, 3], got.blocks, "r", epoch=got.epoch)
    with pytest.raises(ConfigError, match="being streamed") as excinfo:
        pair.a.decline(got, "why")
    names(excinfo, got.epoch, "'b'")
    pair.complete(stream, load)


def test_reject_declining_for_a_removed_peer(pair):
    load, got = offer(pair)
    pair.a.remove_peer("b")
    with pytest.raises(PeerError, match="no live peer") as excinfo:
        pair.a.decline(got, "why")
    names(excinfo, "'b'")


def test_reject_declining_what_is_no_offer(pair):
    with pytest.raises(ConfigError, match="takes an Offer"):
        pair.a.decline(("b", "r", 1, (1,)), "why")  # type: ignore[arg-type]


# -- send: a notification alone -------------------------------------------------------------

def test_send_delivers_a_notification_after_earlier_ones(pair):
    pair.a.write("b", [1], [2], notify=b"first").wait(WAIT)
    sent = pair.a.send("b", b"second")
    sent.wait(WAIT)
    assert sent.stats.nbytes == 0 and sent.state == kvmove.TransferState.DONE
    assert [pair.b.wait_notification(WAIT) for _ in range(2)] == [("a", b"first"),
                                                                   ("a", b"second")]
    pair.landed([1], [2])
    pair.assert_caches()


def test_reject_send_over_64_kib(pair):
    with pytest.raises(ConfigError, match="65537 bytes exceeds the limit of 65536"):
        pair.a.send("b", b"x" * (64 * 1024 + 1))
    pair.a.send("b", b"x" * 64 * 1024).wait(WAIT)
    assert pair.b.wait_notification(WAIT) == ("a", b"x" * 64 * 1024)


def test_reject_send_to_an_unknown_peer(pair):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.a.send("nobody", b"x")
    names(excinfo, "'nobody'")
