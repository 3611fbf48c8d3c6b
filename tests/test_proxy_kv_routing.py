"""The vLLM proxy's KV routing (``kvmove/serve/vllm/kv_routing.py``) without vLLM: vLLM's KV
event batches as its publisher encodes them (msgpack: ``[ts, [event maps], dp_rank]``),
carried over a real ZeroMQ PUB/SUB pair; the index they build; the instance ``score`` picks.
In front of real vLLM: test_vllm_routing.py."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

import kvmove
from kvmove.block_pool import prefix_hashes

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvmove.serve.vllm.kv_routing import (  # noqa: E402 - after the skips
    EventSubscriber,
    Placement,
    event_endpoint,
    score,
)

SIZE = 4
A, B = "http://10.0.0.1:8100", "http://10.0.0.2:8100"


@dataclass
class Inst:
    url: str
    in_flight: int = 0


def stored(hashes, tokens, parent=None, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": SIZE, "lora_id": None, "medium": medium,
            "lora_name": None}


def removed(hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(*events) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


@pytest.fixture
def sub():
    subscriber = EventSubscriber()
    yield subscriber
    subscriber.close()


PROMPT = list(range(100, 113))   # 3 full blocks of 4, and a token to compute


def test_a_prompts_blocks_stored_in_chain_are_matched(sub):
    # vLLM's hashes are opaque bytes: the index chains its own over the same tokens
    sub.apply(A, batch(stored([b"h0", b"h1"], PROMPT[:8]), stored([b"h2"], PROMPT[8:12],
                                                                    parent=b"h1")))
    hashes = prefix_hashes(PROMPT, SIZE)
    assert sub.index.match(A, hashes) == (3, 0)
    assert sub.index.match(B, hashes) == (0, 0)
    decision, _ = score(sub, [Inst(B), Inst(A)], PROMPT, [])
    assert (decision.name, decision.reason, decision.matched_tokens) == (A, "kv_hit", 12)


def test_removed_blocks_and_a_cleared_cache_are_forgotten(sub):
    sub.apply(A, batch(stored([b"h0", b"h1", b"h2"], PROMPT[:12])))
    sub.apply(A, batch(removed([b"h1"])))
    assert sub.index.match(A, prefix_hashes(PROMPT, SIZE)) == (1, 0)
    sub.apply(A, batch({"type": "AllBlocksCleared"}))
    assert sub.index.match(A, prefix_hashes(PROMPT, SIZE)) == (0, 0)


def test_kvmoves_tiers_are_the_store_medium(sub):
    """CPU and STORAGE (kvmove's offload tiers) are the index's store: matched after the
    cached prefix, counted at half a prefill (kv_index.STORE_SAVING). A block demoted from
    CPU to STORAGE stays stored."""
    sub.apply(A, batch(stored([b"h0"], PROMPT[:4]),
                       stored([b"h1", b"h2"], PROMPT[4:12], parent=b"h0", medium="CPU")))
    hashes = prefix_hashes(PROMPT, SIZE)
    assert sub.index.match(A, hashes) == (3, 2)
    sub.apply(A, batch(removed([b"h2"], "CPU"), stored([b"h2"], PROMPT[8:12], parent=b"h1",
                                                       medium="STORAGE")))
    assert sub.index.match(A, hashes) == (3, 2)
    assert sub.counts(A) == {"cache": 1, "store": 2}


def test_what_cannot_be_chained_is_not_indexed(sub):
    # a parent never heard of (subscribed late), partial blocks, other media, garbage
    sub.apply(A, batch(stored([b"h9"], PROMPT[4:8], parent=b"unknown")))
    sub.apply(A, batch(stored([b"h0"], PROMPT[:3])))
    sub.apply(A, batch(stored([b"h0"], PROMPT[:4], medium="NVME-OF")))
    sub.apply(A, b"\xc1 not msgpack")
    sub.apply(A, msgspec.msgpack.encode([1.0]))
    assert sub.counts(A) == {"cache": 0, "store": 0}


def test_placed_requests_count_until_their_prefill_ends(sub):
    """A new prefix's blocks count as held where its first request was placed (they are
    coming), and its uncached tokens as that instance's queue."""
    sub.apply(A, batch(stored([b"x0"], [1, 2, 3, 4])))   # A's block size is known
    decision, hashes = score(sub, [Inst(A), Inst(B)], PROMPT, [])
    assert decision.name == A and decision.reason == "no_match" and len(hashes) == 3
    placed = [Placement(A, set(hashes), decision.uncached_tokens)]
    again, _ = score(sub, [Inst(B, in_flight=1), Inst(A)], PROMPT, placed)
    assert (again.name, again.reason, again.matched_tokens) == (A, "kv_hit", 12)
    alone, _ = score(sub, [Inst(B, in_flight=1), Inst(A)], PROMPT, [])
    assert alone.reason == "no_match"


def test_busy_holder_loses_to_an_idle_instance(sub):
    sub.apply(A, batch(stored([b"h0"], PROMPT[:4])))
    decision, _ = score(sub, [Inst(A, in_flight=5), Inst(B)], PROMPT, [])
    assert (decision.name, decision.reason) == (B, "load")


def test_endpoints_from_kv_event_sources():
    def source(endpoint, on=True):
        return {"enable_kv_cache_events": on, "publisher": "zmq", "endpoint": endpoint}
    assert event_endpoint(source("tcp://*:5557"), A) == "tcp://10.0.0.1:5557"
    assert event_endpoint(source("tcp://*:5557"), "http://[fd00::2]:80") == "tcp://[fd00::2]:5557"
    assert event_endpoint(source("ipc:///run/ev"), A) == "ipc:///run/ev"
    assert event_endpoint(source("tcp://10.9.9.9:5557"), A) is None   # vLLM connects out
    assert event_endpoint(source("tcp://*:5557", on=False), A) is None
    assert event_endpoint({"publisher": "null", "enable_kv_cache_events": True}, A) is None


def test_events_arrive_over_zeromq(sub, tmp_path):
    """A PUB socket as vLLM's publisher binds it, the subscriber connected: multipart
    ``(topic, sequence, payload)`` messages reach the index."""
    endpoint = f"ipc://{tmp_path}/events"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        sub.subscribe(A, endpoint)
        deadline = time.monotonic() + 10.0
        while sub.counts(A)["cache"] == 0 and time.monotonic() < deadline:
            pub.send_multipart((b"", (0).to_bytes(8, "big"),
                                batch(stored([b"h0"], PROMPT[:4]))))   # until joined
            time.sleep(0.05)
        assert sub.counts(A) == {"cache": 1, "store": 0}
        assert kvmove.block_hashes(PROMPT[:4], SIZE)[0] in sub.index._held[(A, "cache")]
    finally:
        pub.close(linger=0)
