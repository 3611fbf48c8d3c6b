"""The vLLM connector's hand-off without vLLM: its prefill part (``pd_prefill.py``) and decode
part (``pd_decode.py``) over two real agents in this process, driven the way ``PDWorker``
drives them from vLLM's calls (steps, layers, holds, loads).

Every test that moves KV compares the decode's blocks with the prefill's, byte for byte, and
every test checks how the hand-off ends on both sides: the request reported to vLLM as sent
(its blocks go back) and as received, and which blocks are load errors. Real vLLM runs the
same parts in tests/test_vllm_connector.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import kvmove
from kvmove.integrations.vllm.params import TransferMode
from kvmove.integrations.vllm.pd_decode import PDDecodeWorker
from kvmove.integrations.vllm.pd_outgoing import Blocks, Outgoing, Send, Share
from kvmove.integrations.vllm.pd_prefill import PDPrefillWorker
from kvmove.integrations.vllm.pd_specs import LoadSpec, PushSpec, SendSpec
from kvmove.integrations.vllm.pd_worker import layer_ready_event

from helpers.checks import within
from helpers.kv import make_cache, pattern, raw_view
from helpers.serve import wait_until

LAYOUT: dict[str, Any] = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
                              block_size=4)
L, NUM_BLOCKS = 4, 16
TCP: dict[str, Any] = {"transports": "tcp", "error_mode": "peer", "peer_timeout": 2.0}
WAIT = 10.0            # every wait that should succeed
TIMEOUT = 20.0         # the parts' load_timeout: a failure must come long before it
LEASE = 30.0


@dataclass
class Step:
    """What ``PDWorker`` hands the prefill part from one step's ``PDMetadata``."""

    pushes: list[PushSpec] = field(default_factory=list)


class Side:
    """One instance's agent and the part of ``PDWorker`` under test, with its lock and pool."""

    def __init__(self, name: str, seed: int | None) -> None:
        self.cache = make_cache(LAYOUT, NUM_BLOCKS)
        self.raw = raw_view(self.cache)
        if seed is not None:
            self.raw[...] = pattern(seed, L, NUM_BLOCKS, self.raw.shape[2])
        self.agent = kvmove.Agent(name, self.cache, host="127.0.0.1", **TCP)
        self.lock = threading.Condition()
        self.pool = ThreadPoolExecutor(4)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        within(15, self.agent.close)


class Link:
    """A prefill part (listening) and a decode part; the decode connects on its first load."""

    def __init__(self) -> None:
        self.p, self.d = Side("prefill", seed=7), Side("decode", seed=None)
        self.host, self.port = self.p.agent.listen("127.0.0.1", 0)
        self.prefill = PDPrefillWorker(self.p.agent, L, LEASE, TIMEOUT, self.p.lock, self.p.pool)
        self.decode = PDDecodeWorker(self.d.agent, TIMEOUT, self.d.lock, self.d.pool)
        self.prefill.start()
        self.sent: set[str] = set()
        self.received: set[str] = set()

    def load(self, req_id: str, key: str, blocks: list[int],
             mode: TransferMode = TransferMode.PULL) -> None:
        self.decode.start([LoadSpec(req_id, key, mode, blocks, self.host, self.port,
                                    len(blocks) * 4)])

    def hold(self, req_id: str, blocks: list[int], *, transfer_id: str | None = None,
             seconds: float = LEASE, abort: bool = False) -> None:
        self.prefill.hold(SendSpec(req_id, transfer_id, blocks, time.monotonic() + seconds,
                                   abort=abort))

    def wait_sent(self, req_id: str) -> None:
        def done() -> bool:
            self.prefill.release_expired(time.monotonic())
            self.sent |= self.prefill.take_sent()
            return req_id in self.sent
        wait_until(done, WAIT, f"the prefill gave {req_id}'s blocks back")

    def wait_received(self, req_id: str) -> set[int]:
        """Waits until the decode's load of ``req_id`` ended; returns the load errors."""
        def done() -> bool:
            self.received |= self.decode.take_received()
            return req_id in self.received
        wait_until(done, WAIT, f"the decode's load of {req_id} ended")
        return self.decode.take_load_errors()

    def landed(self, src: list[int], dst: list[int]) -> None:
        np.testing.assert_array_equal(self.d.raw[:, dst], self.p.raw[:, src])

    def untouched(self, dst: list[int]) -> None:
        assert not self.d.raw[:, dst].any(), "the decode's blocks were written"

    def close(self) -> None:
        self.prefill.close()
        self.p.close()
        self.d.close()


@pytest.fixture
def link() -> Iterator[Link]:
    """The pair; afterwards no lease of the decode's is left (every load ended, its blocks
    free)."""
    link = Link()
    yield link
    stats = link.d.agent.stats
    wait_until(lambda: stats().leases_active == 0 and stats().blocks_quarantined == 0, WAIT,
               lambda: f"the decode's leases ended: {stats()}")
    link.close()


def test_pull_the_decode_offers_after_the_hold(link: Link) -> None:
    link.hold("r1", [1, 2, 3])
    link.load("d1", "r1", [8, 9, 10])
    assert link.wait_received("d1") == set()
    link.landed([1, 2, 3], [8, 9, 10])
    link.wait_sent("r1")


def test_a_decode_that_has_a_prefix_gets_the_last_blocks(link: Link) -> None:
    link.hold("r1", [1, 2, 3, 4])
    link.load("d1", "r1", [8, 9])
    assert link.wait_received("d1") == set()
    link.landed([3, 4], [8, 9])
    link.wait_sent("r1")


def test_push_the_offer_waits_for_the_forward_and_layers_stream_as_saved(link: Link) -> None:
    """Both requests at once: the offer arrives first (a reservation), the forward pass's
    layers go out as they are saved, the blocks go back once vLLM hands them over."""
    link.load("d1", "t1", [8, 9], TransferMode.PUSH)
    wait_until(lambda: "t1" in link.prefill._reservations, WAIT, "the offer is reserved")
    step = Step([PushSpec("r1", "t1", [5, 6])])
    link.prefill.begin_step(step)  # type: ignore[arg-type]
    for layer in range(L):
        link.prefill.save_layer(step, layer)  # type: ignore[arg-type]
    out = link.prefill._out["t1"]
    share = out.shares[0]
    assert share.posted == set(range(L)) and share.send is Send.STREAMING  # not finished yet
    link.prefill.end_forward()
    assert link.wait_received("d1") == set()
    link.landed([5, 6], [8, 9])
    assert share.overlapped == L
    assert "r1" not in link.prefill.take_sent()  # vLLM has not handed the blocks over
    link.hold("r1", [5, 6], transfer_id="t1")
    link.wait_sent("r1")


def test_push_an_offer_after_the_forward_gets_every_layer_at_once(link: Link) -> None:
    step = Step([PushSpec("r1", "t1", [5, 6])])
    link.prefill.begin_step(step)  # type: ignore[arg-type]
    link.prefill.end_forward()
    link.load("d1", "t1", [8, 9], TransferMode.PUSH)
    assert link.wait_received("d1") == set()
    link.landed([5, 6], [8, 9])
    link.hold("r1", [5, 6], transfer_id="t1")
    link.wait_sent("r1")


@pytest.mark.parametrize("offer_first", [True, False], ids=["offer-first", "offer-mid-forward"])
def test_every_layer_is_posted_after_what_marks_it_written(
        link: Link, monkeypatch: pytest.MonkeyPatch, offer_first: bool) -> None:
    """The GPU ordering contract, on the CPU: each layer goes to the stream with the marker
    (a CUDA event on a GPU) saved with it, whether the stream is open when the layer is saved
    or opens later (a layer saved earlier is posted then, still waiting for its own marker).
    The markers are taken off before the real post: this build has no CUDA."""
    posted: dict[int, object] = {}
    real = kvmove.SaveStream.save_layer

    def save_layer(stream: kvmove.SaveStream, layer: int, event: object = None) -> None:
        posted[layer] = event
        real(stream, layer)

    monkeypatch.setattr(kvmove.SaveStream, "save_layer", save_layer)
    marks = {layer: object() for layer in range(L)}
    step = Step([PushSpec("r1", "t1", [5, 6])])
    link.prefill.begin_step(step)  # type: ignore[arg-type]
    if offer_first:
        link.load("d1", "t1", [8, 9], TransferMode.PUSH)
        wait_until(lambda: link.prefill._out["t1"].shares[0].send is Send.STREAMING, WAIT,
                   "streaming")
    for layer in range(L):
        link.prefill.save_layer(step, layer, marks[layer])  # type: ignore[arg-type]
        if not offer_first and layer == 1:
            link.load("d1", "t1", [8, 9], TransferMode.PUSH)
            wait_until(lambda: 1 in posted, WAIT, "the layers saved so far posted")
            assert posted == {0: marks[0], 1: marks[1]}
    link.prefill.end_forward()
    assert link.wait_received("d1") == set()
    link.landed([5, 6], [8, 9])
    assert posted == marks
    assert link.prefill._out["t1"].ready == {}, "no marker kept once its layer is posted"
    link.hold("r1", [5, 6], transfer_id="t1")
    link.wait_sent("r1")


def test_a_host_layer_needs_no_event_and_a_cuda_one_gets_one() -> None:
    torch = pytest.importorskip("torch")
    assert layer_ready_event(torch.zeros(4)) is None
    assert layer_ready_event([torch.zeros(4), torch.zeros(4)]) is None
    if torch.cuda.is_available():    # bench/gpu_check.sh's machine
        event = layer_ready_event(torch.zeros(4, device="cuda"))
        assert isinstance(event, torch.cuda.Event) and event.cuda_event != 0


def test_an_offer_of_nothing_lets_the_blocks_go_without_a_stream(link: Link) -> None:
    link.hold("r1", [1, 2])
    link.load("d1", "r1", [])
    link.wait_sent("r1")
    assert link.decode.take_load_errors() == set()
    assert link.d.agent.stats().leases_granted == 0


def test_a_late_offer_is_declined_and_the_decode_recomputes_at_once(link: Link) -> None:
    link.hold("r1", [1, 2])
    link.load("d1", "r1", [])          # an earlier decode took (none of) it
    link.wait_sent("r1")
    started = time.monotonic()
    link.load("d2", "r1", [8, 9])
    assert link.wait_received("d2") == {8, 9}
    assert time.monotonic() - started < TIMEOUT / 2, "declined, not timed out"
    link.untouched([8, 9])


def test_an_offer_of_more_blocks_than_held_is_declined(link: Link) -> None:
    link.hold("r1", [1, 2])
    link.load("d1", "r1", [8, 9, 10])
    assert link.wait_received("d1") == {8, 9, 10}
    link.untouched([8, 9, 10])
    link.wait_sent("r1")               # nothing will be streamed: the blocks go back


def test_an_offer_the_prefill_cannot_stream_into_is_declined(link: Link) -> None:
    link.hold("r1", [1, NUM_BLOCKS + 3])   # a block the prefill's cache does not have
    started = time.monotonic()
    link.load("d1", "r1", [8, 9])
    assert link.wait_received("d1") == {8, 9}
    assert time.monotonic() - started < TIMEOUT / 2, "declined, not timed out"
    link.untouched([8, 9])
    link.wait_sent("r1")               # nothing streams from them: the blocks go back


def test_an_offer_no_request_comes_for_is_declined_when_its_reservation_ends(
        link: Link) -> None:
    link.load("d1", "t1", [8, 9], TransferMode.PUSH)   # the prefill never sees t1
    wait_until(lambda: "t1" in link.prefill._reservations, WAIT, "the offer is reserved")
    link.prefill.release_expired(time.monotonic())     # not yet: kept
    assert "t1" in link.prefill._reservations
    started = time.monotonic()
    link.prefill.release_expired(time.monotonic() + LEASE + 1.0)
    assert link.wait_received("d1") == {8, 9}
    assert time.monotonic() - started < TIMEOUT / 2, "declined, not timed out"
    assert not link.prefill._reservations
    link.untouched([8, 9])


def test_a_second_offer_for_a_request_being_sent_is_declined(link: Link) -> None:
    step = Step([PushSpec("r1", "t1", [5, 6])])
    link.prefill.begin_step(step)  # type: ignore[arg-type]
    link.load("d1", "t1", [8, 9], TransferMode.PUSH)
    wait_until(lambda: link.prefill._out["t1"].shares[0].send is Send.STREAMING, WAIT,
               "streaming")
    link.load("d2", "t1", [11, 12], TransferMode.PUSH)
    assert link.wait_received("d2") == {11, 12}
    link.prefill.end_forward()
    assert link.wait_received("d1") == set()
    link.landed([5, 6], [8, 9])
    link.untouched([11, 12])


def test_a_lease_no_decode_takes_up_ends_and_the_blocks_go_back(link: Link) -> None:
    link.hold("r1", [1, 2], seconds=0.2)
    link.wait_sent("r1")
    assert "r1" in link.prefill._done_keys  # a decode asking now is declined at once


def test_a_transfer_id_used_twice_leaks_no_blocks(link: Link) -> None:
    """Two requests with one transfer id (a client's): the offer goes to the later one, and
    each one's blocks go back at its lease's end."""
    step = Step([PushSpec("r1", "t1", [5, 6]), PushSpec("r2", "t1", [7, 8])])
    link.prefill.begin_step(step)  # type: ignore[arg-type]
    link.prefill.end_forward()
    link.hold("r1", [5, 6], transfer_id="t1", seconds=0.5)
    link.hold("r2", [7, 8], transfer_id="t1", seconds=0.5)
    link.wait_sent("r1")
    link.wait_sent("r2")
    assert not link.prefill.pending


def test_an_aborted_request_sends_nothing(link: Link) -> None:
    link.hold("r1", [1, 2], abort=True)
    link.wait_sent("r1")
    link.load("d1", "r1", [8, 9])
    assert link.wait_received("d1") == {8, 9}
    link.untouched([8, 9])


def test_a_prefill_nobody_runs_fails_the_load_at_its_deadline(link: Link) -> None:
    """No answer to the metadata exchange: the load fails after load_timeout (1 s here)."""
    with socket.socket() as s:        # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        link.port = s.getsockname()[1]
    link.decode = PDDecodeWorker(link.d.agent, 1.0, link.d.lock, link.d.pool)
    link.load("d1", "r1", [8, 9])
    assert link.wait_received("d1") == {8, 9}
    link.untouched([8, 9])


# ---- the state machine ------------------------------------------------------------------------

def test_the_blocks_go_back_only_when_held_and_sent() -> None:
    out = Outgoing("r1", "t1", [1], Blocks.COMPUTING)
    out.computed(L)
    assert out.layers == set(range(L))
    out.shares[0].skipped()
    with pytest.raises(AssertionError, match="COMPUTED"):
        out.give_back()                # vLLM has not handed them over
    out.hold([1], time.monotonic(), L)
    out.give_back()
    assert out.state is Blocks.RETURNED


def test_the_blocks_go_back_only_once_every_share_is_sent() -> None:
    """A request two decode ranks load (a decode of higher TP): one send each."""
    out = Outgoing("r1", "t1", [1], Blocks.HELD)
    assert out.split(2) and [s.index for s in out.waiting] == [0, 1]
    out.shares[1].skipped()
    assert not out.done and not out.split(1)   # a send began with two: no other count
    with pytest.raises(AssertionError, match="a share is not done"):
        out.give_back()
    out.shares[0].skipped()
    out.give_back()


@pytest.mark.parametrize("transition", ["computed", "closing", "ended", "give_back"])
def test_a_transition_from_the_wrong_state_is_refused(transition: str) -> None:
    out = Outgoing("r1", "t1", [1], Blocks.HELD, shares=[Share("t1", 0, Send.DONE)])
    if transition == "give_back":
        out.shares[0].send = Send.WAITING
    target = out.shares[0] if transition in ("closing", "ended") else out
    with pytest.raises(AssertionError, match="t1"):
        getattr(target, transition)(*([L] if transition == "computed" else []))


def _two_prefill_ranks() -> tuple[list[Side], list[PDPrefillWorker], int]:
    """Prefill ranks 0 and 1 (other KV in each, as other heads), listening on ``port`` and
    ``port + 1`` as vLLM's ranks do on ``kv_port + rank``."""
    for _ in range(20):
        sides = [Side(f"prefill-r{r}", seed=7 + r) for r in (0, 1)]
        port = sides[0].agent.listen("127.0.0.1", 0)[1]
        try:
            sides[1].agent.listen("127.0.0.1", port + 1)
        except kvmove.PeerError:  # taken: another pair
            for side in sides:
                side.close()
            continue
        parts = [PDPrefillWorker(s.agent, L, LEASE, TIMEOUT, s.lock, s.pool) for s in sides]
        for part in parts:
            part.start()
        return sides, parts, port
    raise AssertionError("no two free ports in a row")


def test_a_decode_rank_loads_from_the_prefill_rank_of_its_own() -> None:
    """Tensor parallelism 2 on both sides: decode rank 1 loads rank 1's KV (every decode rank
    loaded from rank 0's port: rank 1 got rank 0's heads). A prefill of another tensor
    parallelism is refused at once, naming both, and the blocks are recomputed."""
    sides, parts, port = _two_prefill_ranks()
    decode = Side("decode-r1", seed=None)
    rank1 = PDDecodeWorker(decode.agent, TIMEOUT, decode.lock, decode.pool, tp_rank=1,
                           tp_size=2)
    single = PDDecodeWorker(decode.agent, TIMEOUT, decode.lock, decode.pool)  # TP 1
    try:
        for part in parts:  # each prefill rank holds the same request's same blocks
            part.hold(SendSpec("r1", None, [1, 2, 3], time.monotonic() + LEASE))
        rank1.start([LoadSpec("d1", "r1", TransferMode.PULL, [8, 9, 10], "127.0.0.1", port,
                              12, remote_tp_size=2)])
        wait_until(lambda: "d1" in rank1.take_received(), WAIT, "rank 1's load ended")
        assert rank1.take_load_errors() == set()
        np.testing.assert_array_equal(decode.raw[:, [8, 9, 10]], sides[1].raw[:, [1, 2, 3]])
        assert (decode.raw[:, [8, 9, 10]] != sides[0].raw[:, [1, 2, 3]]).any()

        started = time.monotonic()
        single.start([LoadSpec("d2", "r1", TransferMode.PULL, [11, 12, 13], "127.0.0.1",
                               port, 12, remote_tp_size=2)])
        wait_until(lambda: "d2" in single.take_received(), WAIT, "the refused load ended")
        assert single.take_load_errors() == {11, 12, 13}
        assert time.monotonic() - started < TIMEOUT / 2, "refused, not timed out"
        assert not decode.raw[:, [11, 12, 13]].any()
    finally:
        for part in parts:
            part.close()
        for side in (*sides, decode):
            side.close()
