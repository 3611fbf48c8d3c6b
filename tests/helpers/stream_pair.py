"""Two agents in one process, "a" sending to "b": the set-up of the streams' rejection
tests and of the hand-off's (offer) tests. Validation happens before anything moves, so one
process is enough and fast; every such test checks that nothing changed: the same stream (or a
new one) still completes, and lands exactly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import kvmove
from kvmove import StreamState

from helpers.checks import within
from helpers.kv import make_cache, pattern, raw_view

# 12 layers (more than the 8 missing layers finish() lists), 512 B per block per layer; "a"
# has 16 blocks, "b" 12 (so remote ids are checked against the peer's size).
LAYOUT = dict(num_layers=12, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
PL = 12
A_BLOCKS, B_BLOCKS = 16, 12
# peer_timeout low, so a dead peer is declared dead by keepalive within seconds.
TCP = {"transports": "tcp", "error_mode": "peer", "peer_timeout": 2.0}
WAIT = 10.0  # deadline of every wait that should succeed, seconds


class Pair:
    """Agent "a" (16 blocks of random bytes) sends to agent "b" (12 zero blocks), both here;
    ``a_ref`` / ``b_ref`` are what their caches must hold."""

    def __init__(self, a_kwargs: dict | None = None, b_kwargs: dict | None = None) -> None:
        self.a_cache, self.b_cache = make_cache(LAYOUT, A_BLOCKS), make_cache(LAYOUT, B_BLOCKS)
        self.a_raw, self.b_raw = raw_view(self.a_cache), raw_view(self.b_cache)
        self.a_raw[...] = pattern(99, PL, A_BLOCKS, self.a_raw.shape[2])
        self.a = kvmove.Agent("a", self.a_cache, **{**TCP, **(a_kwargs or {})})
        self.b = kvmove.Agent("b", self.b_cache, **{**TCP, **(b_kwargs or {})})
        assert self.a.add_peer(self.b.metadata()) == "b"
        assert self.b.add_peer(self.a.metadata()) == "a"
        self.a_ref, self.b_ref = self.a_raw.copy(), self.b_raw.copy()

    def start(self, rid: str, src: Sequence[int] = (1, 2, 3), dst: Sequence[int] = (4, 5, 6)
              ) -> tuple[kvmove.SaveStream, kvmove.LoadStream]:
        load = self.b.expect("a", rid, dst).start_load()
        return self.a.stream_to("b", src, dst, rid, epoch=load.epoch), load

    def epoch(self) -> int:
        """An epoch of b's incarnation that b never granted (rejection tests stop before it
        matters)."""
        return (self.b.incarnation << 32) | 0xFFFFFF

    def complete(self, stream: kvmove.SaveStream, load: kvmove.LoadStream,
                 src: Sequence[int] = (1, 2, 3), payload: bytes = b"done",
                 saved: tuple[int, ...] = ()) -> None:
        """Saves every layer but ``saved`` (those the test saved already), finishes with
        ``payload``; the receiver gets it and exactly ``src``'s bytes in its blocks, and
        nothing else changed on either side."""
        for i in range(PL):
            if i not in saved:
                stream.save_layer(i)
        stream.finish(payload)
        stream.wait_for_save(WAIT)
        assert stream.state == StreamState.DONE
        assert load.wait_all(WAIT) == payload
        assert load.state == StreamState.DONE
        self.landed(src, load.local_ids)
        self.assert_caches()

    def landed(self, src: Sequence[int], dst: Sequence[int], layers: Any = slice(None)
               ) -> None:
        """Layers ``layers`` of ``src`` are now in ``dst`` of b."""
        self.b_ref[layers, dst] = self.a_ref[layers, src]

    def assert_caches(self) -> None:
        np.testing.assert_array_equal(self.b_raw, self.b_ref)
        np.testing.assert_array_equal(self.a_raw, self.a_ref)

    def assert_usable(self, rid: str = "after") -> None:
        """A new stream a -> b completes exactly."""
        self.complete(*self.start(rid, [7, 8], [0, 11]), src=[7, 8])

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        within(15, self.a.close)
        within(15, self.b.close)

