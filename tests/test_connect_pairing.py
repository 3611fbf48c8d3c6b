"""A connect's two endpoints must pair (``Join`` in csrc/transport/agent.h).

UCX pairs an endpoint with the peer's by how many endpoints each side has made to the other,
and kvmove knows a message's sender only by the endpoint it came over. A connect whose answer
was lost (the client timed out, as on a loaded host) left the listener with one endpoint more
than the client: when the client connected again, the listener replaced its endpoint, the two
sides' counts stayed one apart, and every message between them came over an endpoint that
was no peer's and was dropped. Sends still succeeded, so nothing failed: every lease the
receiver granted expired with "no Begin from the sender arrived".

Here the lost answer is real: the client's signed metadata goes to the real listener over
ZeroMQ and the socket closes before the answer is read. The listener ("p", a prefill) streams
into the client's lease ("d", a decode), and each sends the other a notification.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import kvmove

from helpers.checks import wait_until
from helpers.kv import make_cache, pattern, raw_view

LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
NUM_BLOCKS = 8
WAIT = 10.0
PATHS = {"tcp": {"transports": "tcp", "error_mode": "peer", "same_host": "ucx"},
         "mapped": {"error_mode": "peer"}}


@pytest.fixture(params=sorted(PATHS))
def agents(request):
    p = kvmove.Agent("p", make_cache(LAYOUT, NUM_BLOCKS), **PATHS[request.param])
    d = kvmove.Agent("d", make_cache(LAYOUT, NUM_BLOCKS), **PATHS[request.param])
    raw = raw_view(p.cache)
    raw[...] = pattern(7, LAYOUT["num_layers"], NUM_BLOCKS, raw.shape[2])
    try:
        yield p, d, p.listen()
    finally:
        d.close()
        p.close()


def answer_lost(d: kvmove.Agent, p: kvmove.Agent, address: tuple[str, int]) -> None:
    """``d`` asks ``p``'s listener to connect, and goes away before the answer: ``p`` has
    taken ``d`` (again), ``d`` knows nothing of it."""
    joined = p.listener_stats().joined
    context = zmq.Context()
    try:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address[0]}:{address[1]}")
        sock.send(d.metadata())
        wait_until(lambda: p.listener_stats().joined > joined, WAIT,
                   lambda: f"the listener did not take the connect: {p.listener_stats()}")
        sock.close(linger=0)
    finally:
        context.term()


def assert_pair_hears(p: kvmove.Agent, d: kvmove.Agent, rid: str) -> None:
    """A stream p -> d lands exactly; a notification goes each way; nothing is dropped."""
    src, dst = [1, 2, 5], [0, 3, 6]
    load = d.expect("p", rid, dst).start_load()
    stream = p.stream_to("d", src, dst, rid, epoch=load.epoch)
    for layer in range(LAYOUT["num_layers"]):
        stream.save_layer(layer)
    stream.finish(b"all")
    assert load.wait_all(WAIT) == b"all"
    np.testing.assert_array_equal(raw_view(d.cache)[:, dst], raw_view(p.cache)[:, src])
    p.send("d", b"to d").wait(WAIT)
    d.send("p", b"to p").wait(WAIT)
    assert d.wait_notification(WAIT) == ("p", b"to d")
    assert p.wait_notification(WAIT) == ("d", b"to p")
    assert (p.stats().unknown_senders, d.stats().unknown_senders) == (0, 0)


def test_a_connect_whose_answer_was_lost_pairs_when_tried_again(agents):
    """The first connect's answer lost, the second connect's endpoints pair: before, the
    stream's lease expired unengaged and both notifications were dropped as no peer's."""
    p, d, address = agents
    answer_lost(d, p, address)
    assert p.peers == ["d"] and d.peers == []
    assert d.connect(*address, timeout=WAIT) == "p"
    assert_pair_hears(p, d, "after-a-lost-answer")


def test_a_reconnect_whose_answer_was_lost_pairs_when_tried_again(agents):
    """Connected and heard; a reconnect (the client's fresh endpoints) loses its answer: the
    listener replaced its endpoint, the client kept its old one. The next connect pairs."""
    p, d, address = agents
    assert d.connect(*address, timeout=WAIT) == "p"
    assert_pair_hears(p, d, "first")
    answer_lost(d, p, address)
    assert d.connect(*address, timeout=WAIT) == "p"
    assert_pair_hears(p, d, "after-a-lost-reconnect")


def test_a_reconnect_after_the_client_dropped_the_listener_replaces_both_endpoints(agents):
    """The listener keeps an endpoint only while the client never spoke over it: a client
    that connected (and said hello), dropped the listener and connects again gets fresh
    endpoints on both sides, not a kept one that no longer has a partner."""
    p, d, address = agents
    assert d.connect(*address, timeout=WAIT) == "p"
    d.remove_peer("p")
    time.sleep(0.2)  # the removed endpoint's close reaches p (it may not: either must work)
    assert d.connect(*address, timeout=WAIT) == "p"
    assert_pair_hears(p, d, "after-a-drop")
