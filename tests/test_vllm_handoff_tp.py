"""The vLLM connector's hand-off between a prefill and a decode of different tensor
parallelism, without vLLM: the prefill and decode parts (``pd_prefill.py``, ``pd_decode.py``)
over real agents in this process, each rank's cache in vLLM's CPU order
(``[H, B, 2D]`` per block, read as ``[H, 2B, D]``: a rank's heads are a contiguous run of each
block's bytes).

TP 2 -> 1: the decode loads each prefill rank's heads through a staging area of that rank's
layout and converts them into their half of its blocks. TP 1 -> 2: each decode rank loads the
whole request from the one prefill rank and keeps its heads; the prefill streams it once per
rank and gives the blocks back only once both were served. The expected bytes are cut from the
prefill ranks' bytes with numpy, never through kvmove. Real vLLM runs the same parts in
tests/test_vllm_tp.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import kvmove
from kvmove.errors import ConfigError
from kvmove.integrations.vllm.params import TransferMode
from kvmove.integrations.vllm.pd_decode import PDDecodeWorker
from kvmove.integrations.vllm.pd_prefill import PDPrefillWorker
from kvmove.integrations.vllm.pd_specs import LoadSpec, SendSpec
from kvmove.integrations.vllm.tp import parse_share, share_key, sources

from helpers.checks import within
from helpers.kv import pattern, raw_view
from helpers.serve import wait_until

HEADS = 4                     # the model's KV heads
L, NUM_BLOCKS = 3, 16
TCP: dict[str, Any] = {"transports": "tcp", "error_mode": "peer", "peer_timeout": 2.0}
WAIT = 10.0
TIMEOUT = 20.0
LEASE = 30.0


def _layout(heads: int) -> kvmove.KVSpec:
    return kvmove.KVSpec(num_layers=L, num_kv_heads=heads, head_dim=8, dtype="float16",
                         block_size=4)


class Rank:
    """One vLLM worker's agent over a cache in vLLM's CPU order, with its part's lock and
    pool; a prefill rank listens."""

    def __init__(self, name: str, tp_size: int, rank: int, seed: int | None) -> None:
        heads = HEADS // tp_size
        self.cache = kvmove.KVCache(_layout(heads), NUM_BLOCKS, order="vllm-cpu")
        self.raw = raw_view(self.cache)
        if seed is not None:
            self.raw[...] = pattern(seed, L, NUM_BLOCKS, self.raw.shape[2])
        self.tp_size, self.rank = tp_size, rank
        self.agent = kvmove.Agent(name, self.cache, kv_heads=(rank * heads, HEADS),
                                  host="127.0.0.1", **TCP)
        self.lock = threading.Condition()
        self.pool = ThreadPoolExecutor(4)
        self.prefill: PDPrefillWorker | None = None
        self.decode: PDDecodeWorker | None = None

    def as_prefill(self, port: int) -> PDPrefillWorker:
        self.agent.listen("127.0.0.1", port)
        self.prefill = PDPrefillWorker(self.agent, L, LEASE, TIMEOUT, self.lock, self.pool)
        self.prefill.start()
        return self.prefill

    def as_decode(self) -> PDDecodeWorker:
        self.decode = PDDecodeWorker(self.agent, TIMEOUT, self.lock, self.pool,
                                     tp_rank=self.rank, tp_size=self.tp_size,
                                     total_kv_heads=HEADS, staging_blocks=4,
                                     agent_kwargs={"host": "127.0.0.1", **TCP})
        return self.decode

    def load(self, req_id: str, blocks: list[int], port: int,
             prefill_tp: int | None) -> set[int]:
        """Loads ``req_id`` (held by the prefill ranks on ``port + r``); the load errors."""
        assert self.decode is not None
        self.decode.start([LoadSpec(req_id, req_id, TransferMode.PULL, blocks, "127.0.0.1",
                                    port, len(blocks) * 4, remote_tp_size=prefill_tp)])
        wait_until(lambda: req_id in self.decode.take_received(), WAIT,  # type: ignore
                   f"{self.agent.name}'s load of {req_id} ended")
        return self.decode.take_load_errors()

    def heads(self, blocks: list[int], first: int, count: int) -> np.ndarray:
        """Heads ``[first, first + count)`` of this rank's (local numbering) ``blocks``."""
        per_head = self.raw.shape[2] // self.cache.layout.num_kv_heads
        return self.raw[:, blocks, first * per_head:(first + count) * per_head]

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
        if self.decode is not None:
            self.decode.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        within(15, self.agent.close)


def _free_ports(count: int) -> int:
    """A port with the ``count - 1`` after it free (vLLM's ranks on ``kv_port + rank``)."""
    import socket
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + count < 65536:
            return port
    raise AssertionError("no free port")


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for rank in made:
        if rank.decode is not None:
            stats = rank.agent.stats
            wait_until(lambda: stats().leases_active == 0, WAIT,  # noqa: B023
                       lambda: f"the decode's leases ended: {stats()}")  # noqa: B023
        rank.close()


def _prefills(ranks: list[Rank], tp: int) -> tuple[list[Rank], int]:
    for _ in range(20):
        port = _free_ports(tp)
        made = [Rank(f"prefill-{r}", tp, r, seed=7 + r) for r in range(tp)]
        try:
            for r, rank in enumerate(made):
                rank.as_prefill(port + r)
        except kvmove.PeerError:   # a port was taken meanwhile: another try
            for rank in made:
                rank.close()
            continue
        ranks.extend(made)
        return made, port
    raise AssertionError("no free ports in a row")


def _hold(prefills: list[Rank], req_id: str, blocks: list[int]) -> None:
    for rank in prefills:   # vLLM gives every rank the same block ids
        assert rank.prefill is not None
        rank.prefill.hold(SendSpec(req_id, None, blocks, time.monotonic() + LEASE))


def _sent(rank: Rank, req_id: str, seen: set[str]) -> bool:
    assert rank.prefill is not None
    rank.prefill.release_expired(time.monotonic())
    seen |= rank.prefill.take_sent()
    return req_id in seen


@pytest.mark.parametrize("said", [2, None], ids=["tp-said", "tp-from-metadata"])
def test_a_tp2_prefill_into_a_tp1_decode_merges_the_ranks_heads(ranks: list[Rank],
                                                                said: int | None) -> None:
    """The prefill's TP is its answer's tp_size, or (push: no answer came first) what its rank
    0 agent's metadata says."""
    prefills, port = _prefills(ranks, 2)
    decode = Rank("decode", 1, 0, seed=None)
    ranks.append(decode)
    decode.as_decode()
    src, dst = [1, 2, 3], [9, 5, 12]
    _hold(prefills, "r1", src)
    assert decode.load("r1", dst, port, prefill_tp=said) == set()
    for r, rank in enumerate(prefills):
        np.testing.assert_array_equal(decode.heads(dst, 2 * r, 2), rank.heads(src, 0, 2))
    for rank in prefills:
        seen: set[str] = set()
        wait_until(lambda: _sent(rank, "r1", seen), WAIT,  # noqa: B023
                   f"{rank.agent.name} gave r1's blocks back")
    assert decode.decode is not None and all(a.num_free == 4 for a in
                                             decode.decode._staging.values())


def test_a_tp1_prefill_into_tp2_decode_ranks_sends_each_rank_its_heads(
        ranks: list[Rank]) -> None:
    """The prefill holds the blocks until both decode ranks were served."""
    (prefill,), port = _prefills(ranks, 1)
    decodes = [Rank(f"decode-{r}", 2, r, seed=None) for r in range(2)]
    ranks.extend(decodes)
    for rank in decodes:
        rank.as_decode()
    src, dst = [4, 6], [[8, 3], [0, 15]]
    _hold([prefill], "r1", src)
    seen: set[str] = set()
    assert decodes[0].load("r1", dst[0], port, prefill_tp=1) == set()
    assert not _sent(prefill, "r1", seen), "given back before decode rank 1 was served"
    assert decodes[1].load("r1", dst[1], port, prefill_tp=1) == set()
    for r, rank in enumerate(decodes):
        np.testing.assert_array_equal(rank.heads(dst[r], 0, 2), prefill.heads(src, 2 * r, 2))
    wait_until(lambda: _sent(prefill, "r1", seen), WAIT, "the prefill gave r1's blocks back")


def test_a_share_never_offered_keeps_the_blocks_until_the_lease_ends(ranks: list[Rank]) -> None:
    """Decode rank 1 never asks: the prefill gives the blocks back at the lease's end, not
    before, and not never."""
    (prefill,), port = _prefills(ranks, 1)
    decode = Rank("decode-0", 2, 0, seed=None)
    ranks.append(decode)
    decode.as_decode()
    assert prefill.prefill is not None
    prefill.prefill.hold(SendSpec("r1", None, [4, 6], time.monotonic() + 1.5))
    assert decode.load("r1", [8, 3], port, prefill_tp=1) == set()
    seen: set[str] = set()
    assert not _sent(prefill, "r1", seen)
    wait_until(lambda: _sent(prefill, "r1", seen), WAIT, "given back at the lease's end")


def test_a_decode_rank_paired_with_another_ranks_heads_is_refused(ranks: list[Rank]) -> None:
    """Decode rank 1 sent to prefill rank 0 (a wrong port: ``port - 1`` + rank 1) is refused
    before any byte moves, as the agents declare their heads; without that, two ranks of two
    heads each look alike and rank 0's heads would land as rank 1's."""
    prefills, port = _prefills(ranks, 2)
    decode = Rank("decode-1", 2, 1, seed=None)
    ranks.append(decode)
    decode.as_decode()
    _hold(prefills, "r1", [1, 2])
    assert decode.load("r1", [8, 9], port - 1, prefill_tp=2) == {8, 9}
    assert not decode.raw[:, [8, 9]].any()


def test_the_sources_of_a_decode_rank() -> None:
    assert [(s.rank, s.heads, s.share, s.shares) for s in sources(8, 2, 1, 0)] == \
        [(0, (0, 8), 0, 1), (1, (4, 8), 0, 1)]
    assert [(s.rank, s.heads, s.share, s.shares) for s in sources(8, 1, 2, 1)] == \
        [(0, (0, 8), 1, 2)]
    assert [(s.rank, s.share, s.shares) for s in sources(8, 2, 4, 3)] == [(1, 1, 2)]
    assert [s.rank for s in sources(8, 4, 2, 1)] == [2, 3]
    with pytest.raises(ConfigError, match="does not split the model's 2 KV heads evenly"):
        sources(2, 4, 1, 0)


def test_a_share_key_round_trips_and_a_bad_one_is_refused() -> None:
    assert share_key("t#1", 0, 1) == "t#1" and parse_share("t#1") == ("t#1", 0, 1)
    assert parse_share(share_key("t#kvmove-share=x", 1, 2)) == ("t#kvmove-share=x", 1, 2)
    for bad in ("t#kvmove-share=2/2", "t#kvmove-share=1", "t#kvmove-share=-1/2",
                "t#kvmove-share=0/5000"):
        with pytest.raises(ConfigError, match="its share must be i/n"):
            parse_share(bad)
