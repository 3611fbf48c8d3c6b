"""The reference engine's KV hand-off (``kvmove/engine/prefill_handoff.py``,
``EngineWorker.start_load``): the decode worker leases its blocks and offers them to the
prefill worker by kvmove (``Agent.offer``); the router only says which decode worker a
request's KV goes to. Offer and request arrive by different roads, in either order.

Both workers in this process, their agents peers over tcp; each test steps them by hand. The
answer of every hand-off is compared with the same request on one colocated worker (the model's
output depends on the KV it reads: ``test_engine.py`` shows a corrupted block changes it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import FinishReason, Request, SamplingParams
from kvmove.engine.worker import EngineWorker
from kvmove.errors import PeerError

from helpers.checks import names

BLOCK = 4
NUM_BLOCKS = 32
PROMPT = [(7 * i) % 250 + 1 for i in range(13)]  # 4 blocks
TCP = {"transports": "tcp", "peer_timeout": 5.0}
DEADLINE = 30.0  # seconds a hand-off may take here, however loaded the machine


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0)


def params() -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> list[int]:
    worker = EngineWorker(model, num_blocks=NUM_BLOCKS, block_size=BLOCK)
    request = Request("ref", PROMPT, params())
    worker.add_request(request)
    worker.run()
    return request.output


class Pair:
    def __init__(self, model: LlamaForCausalLM, timeout: float = 10.0,
                 prefill_faults: str = "") -> None:
        kwargs = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK, transfer_timeout=timeout)
        self.prefill = EngineWorker(model, role="prefill", name="p", **kwargs,
                                    agent_kwargs={**TCP, "faults": prefill_faults})
        self.decode = EngineWorker(model, role="decode", name="d", agent_kwargs=TCP, **kwargs)
        self.decode.agent.add_peer(self.prefill.agent.metadata())
        self.prefill.agent.add_peer(self.decode.agent.metadata())

    def step_until(self, done, what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not after {DEADLINE} s: {what}")
            self.prefill.step()
            self.decode.step()

    def idle(self) -> None:
        """Every block back on both sides, no lease left."""
        self.step_until(lambda: not (self.prefill.has_work or self.decode.has_work), "idle")
        assert self.prefill.cache.pool.num_free == NUM_BLOCKS
        assert self.decode.cache.pool.num_free == NUM_BLOCKS
        assert self.decode.agent.stats().leases_active == 0

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pair(model: LlamaForCausalLM) -> Iterator[Pair]:
    p = Pair(model)
    try:
        yield p
    finally:
        p.close()


def reserve(pair: Pair, rid: str) -> Request:
    request = Request(rid, PROMPT, params())
    assert pair.decode.reserve(request) is not None
    pair.decode.start_load(request, "p")
    return request


def test_the_offer_first_then_the_request(pair, reference):
    """The usual order: the decode's offer is in before the prefill computes the prompt."""
    received = reserve(pair, "r")
    pair.prefill.add_request(Request("r", PROMPT, params()), decode_peer="d")
    pair.step_until(lambda: received.finished, "the request decoded")
    assert received.finish_reason is FinishReason.LENGTH
    assert received.output == reference
    pair.idle()


def test_an_offer_later_than_the_prompt_streams_every_layer_when_it_comes(pair, reference):
    """The prefill computed the prompt (its first token is sampled) before the offer came:
    the request waits, holding its blocks, and streams every layer at once when it does."""
    sent = Request("r", PROMPT, params())
    pair.prefill.add_request(sent, decode_peer="d")
    for _ in range(10):
        pair.prefill.step()
    assert sent.output and not sent.finished and pair.prefill.has_work
    received = reserve(pair, "r")
    # both sides: the prefill's request ends once the decode acknowledged the Final, which
    # may come after the decode finished (CI, loaded, saw it still handing off)
    pair.step_until(lambda: received.finished and sent.finished, "the request decoded")
    assert sent.finish_reason is FinishReason.HANDED_OFF
    assert received.output == reference
    # its hand-off is timed from the prompt's last layer (waiting for the offer included), on
    # both sides, as a streamed one's: kvmove-serve's hand-off timeline counts it
    last_layer = sent.timings.last_layer
    assert last_layer is not None and received.timings.last_layer == last_layer
    assert last_layer < sent.timings.kv_final <= sent.timings.kv_sent
    assert last_layer < received.timings.kv_landed <= received.timings.kv_end
    pair.idle()


def test_a_request_whose_offer_never_comes_fails_and_frees_its_blocks(model):
    pair = Pair(model, timeout=0.5)
    try:
        sent = Request("r", PROMPT, params())
        pair.prefill.add_request(sent, decode_peer="d")
        deadline = time.monotonic() + 10.0
        while not sent.finished and time.monotonic() < deadline:
            pair.prefill.step()
        assert sent.finish_reason is FinishReason.ABORT
        assert "no offer" in sent.error and "0.5 s" in sent.error
        pair.idle()
    finally:
        pair.close()


def test_a_hand_off_past_its_deadline_is_aborted_once_not_at_every_step(model, caplog):
    """Each layer waits 0.5 s before it is posted: the stream is still open well past the
    0.3 s transfer_timeout while the prefill steps as fast as it can. It is aborted (and logged)
    once; the soak saw the abort and its warning repeated at every 1 ms poll until the stream
    ended, ~1,600 lines a second."""
    pair = Pair(model, timeout=0.3, prefill_faults="delay_post_us=500000")
    try:
        received = reserve(pair, "r")
        sent = Request("r", PROMPT, params())
        pair.prefill.add_request(sent, decode_peer="d")
        with caplog.at_level("WARNING", logger="kvmove.engine.prefill_handoff"):
            pair.step_until(lambda: sent.finished and received.finished, "both ended")
        aborts = [r for r in caplog.records if "passed transfer_timeout" in r.getMessage()]
        assert len(aborts) == 1, len(aborts)
        assert sent.finish_reason is FinishReason.ABORT
        pair.idle()
    finally:
        pair.close()


def test_an_offer_of_a_request_aborted_on_the_prefill_is_declined(pair):
    """The prefill worker drops the request (its client went away) while the decode's offer
    waits: the offer is declined, and the decode's load fails at once instead of at its
    lease's deadline; its blocks come back."""
    pair.prefill.add_request(Request("r", PROMPT, params()), decode_peer="d")
    received = reserve(pair, "r")
    pair.decode.agent.send("p", b"after the offer").wait(5.0)
    assert pair.prefill.agent.wait_notification(5.0)[1] == b"after the offer"  # offer's in
    assert pair.prefill.abort("r") is not None
    pair.step_until(lambda: received.finished, "the load ended")
    assert received.finish_reason is FinishReason.ABORT
    assert "declined" in received.error and "aborted" in received.error, received.error
    pair.idle()


def test_an_offer_to_an_unknown_prefill_frees_the_reserved_blocks(pair):
    """A reserve whose offer cannot be made (its prefill worker is gone) gives its blocks back
    and raises: it used to leak them, one set per such request."""
    request = Request("r", PROMPT, params())
    assert pair.decode.reserve(request) is not None
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.decode.start_load(request, "gone")
    names(excinfo, "'gone'")
    assert pair.decode.cache.pool.num_free == NUM_BLOCKS and not request.blocks
    pair.idle()
