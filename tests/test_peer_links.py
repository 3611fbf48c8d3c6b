"""A worker's kvmove peers kept connected (``kvmove/serve/peer_links.py``), over two real
agents: a peer lost is named (``/health`` reports it), connected to again, and forgotten once
the router says its process died (its old address was tried every second, forever, and an
offer's reconnect spent 2 s of the worker's loop on it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import kvmove
from kvmove.serve.peer_links import PeerLinks

from helpers.kv import make_cache

LAYOUT = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
TCP = {"transports": "tcp", "error_mode": "peer"}


@pytest.fixture
def agents() -> Iterator[tuple[kvmove.Agent, kvmove.Agent]]:
    decode = kvmove.Agent("decode-0", make_cache(LAYOUT, 8), **TCP)
    prefill = kvmove.Agent("prefill-0", make_cache(LAYOUT, 8), **TCP)
    try:
        yield decode, prefill
    finally:
        decode.close()
        prefill.close()


def test_a_lost_peer_is_named_connected_to_again_and_forgotten_when_gone(
        agents: tuple[kvmove.Agent, kvmove.Agent]) -> None:
    decode, prefill = agents
    links = PeerLinks(decode)
    assert links.connect(*prefill.listen("127.0.0.1")) == "prefill-0"
    assert links.lost() == []
    decode.remove_peer("prefill-0")  # as a cut-off does
    assert links.lost() == ["prefill-0"]
    assert links.reconnect("prefill-0") and links.lost() == []
    decode.remove_peer("prefill-0")
    links.forget("prefill-0")
    assert links.lost() == []
    assert not links.reconnect("prefill-0")  # its address is forgotten
    assert not decode.peer_alive("prefill-0")
