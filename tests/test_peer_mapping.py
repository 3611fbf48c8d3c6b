"""The same-host mapped path (csrc/transport/peer_mapping.h, agent_copies.cpp): two agents in
two processes on this host map each other's memfd, and a transfer is a memcpy.

Real processes, no mocks: the far agent runs in a spawned child (``helpers.far``), every byte
moves through ``kvmove.Agent``. Each test asserts which path ran (``Agent.peer_path``). The
fallback to UCX for a peer on another "host" is in test_two_hosts.py (a network namespace).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvmove
from kvmove import _C
from kvmove.errors import PeerError

from helpers import wire
from helpers.far import FarPeer
from helpers.kv import fill, make_cache, raw_view

# 64 KiB per block and layer: a transfer of many blocks goes to the copy threads (above the
# 256 KiB copied inline by the posting thread); a single block is copied inline.
LAYOUT = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
NUM_BLOCKS = 64
WAIT = 10.0
# 32 layers x 64 KiB x 64 blocks = 128 MiB a cache: several writes of every block are surely
# still copying when the far process is killed a moment after they are posted.
BIG_LAYOUT = dict(LAYOUT, num_layers=32)
DEATH_DEADLINE = 10.0


@pytest.fixture
def far() -> Iterator[FarPeer]:
    peer = FarPeer("far", LAYOUT, NUM_BLOCKS, {})
    try:
        yield peer
    finally:
        peer.stop()


def connect(near: kvmove.Agent, far: FarPeer) -> str:
    host, port = far.call("listen")
    return near.connect(host, port, timeout=WAIT)


def memfd_inodes() -> set[int]:
    """Inodes of the kvmove memfds mapped into this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return {int(line.split()[4]) for line in maps if "memfd:kvmove-region" in line}


def segment_inode(agent_metadata: bytes, key: kvmove.auth.DeploymentKey) -> int:
    return _C.decode_metadata(key.verify(agent_metadata))["segments"][0][5]


def shuffled_runs(seed: int, n: int) -> tuple[list[int], list[int]]:
    """n local ids paired with n remote ids, both scattered: many short runs, a few long."""
    rng = np.random.default_rng(seed)
    local = rng.permutation(NUM_BLOCKS)[:n].tolist()
    remote = sorted(rng.permutation(NUM_BLOCKS)[:n].tolist())
    return local, remote


@pytest.mark.parametrize("layers", [None, [0], [1, 3]])
def test_write_is_byte_exact_through_the_mapping(far, layers):
    cache = make_cache(LAYOUT, NUM_BLOCKS)
    expected_far = far.call("snapshot")
    mine = fill(cache, 11)
    with kvmove.Agent("near", cache) as near:
        peer = connect(near, far)
        assert near.peer_path(peer) == "mapped"
        local, remote = shuffled_runs(1, 48)
        t = near.write(peer, local, remote, layers=layers, notify=b"w")
        t.wait(WAIT)
        assert t.state == kvmove.TransferState.DONE
        assert far.call("wait_notification", WAIT) == ("near", b"w")
        rows = range(LAYOUT["num_layers"]) if layers is None else layers
        expected_far[np.ix_(rows, remote)] = mine[np.ix_(rows, local)]
        np.testing.assert_array_equal(far.call("snapshot"), expected_far)
        np.testing.assert_array_equal(raw_view(cache), mine)


@pytest.mark.parametrize("layers", [None, [2]])
def test_read_is_byte_exact_through_the_mapping(far, layers):
    cache = make_cache(LAYOUT, NUM_BLOCKS)
    far.call("fill", 5)
    theirs = far.call("snapshot")
    with kvmove.Agent("near", cache) as near:
        peer = connect(near, far)
        assert near.peer_path(peer) == "mapped"
        local, remote = shuffled_runs(2, 40)
        expected = raw_view(cache).copy()
        near.read(peer, local, remote, layers=layers, notify=b"r").wait(WAIT)
        assert far.call("wait_notification", WAIT) == ("near", b"r")
        rows = range(LAYOUT["num_layers"]) if layers is None else layers
        expected[np.ix_(rows, local)] = theirs[np.ix_(rows, remote)]
        np.testing.assert_array_equal(raw_view(cache), expected)
        np.testing.assert_array_equal(far.call("snapshot"), theirs)  # a read changes nothing


def test_each_notification_comes_after_its_bytes(far):
    """The far agent posts 12 writes of 8 blocks at once, each with a notification; here each
    notification's blocks are copied the moment it arrives, and must already hold the
    sender's bytes (copies complete in posting order, the message goes after)."""
    cache = make_cache(LAYOUT, NUM_BLOCKS)
    far.call("fill", 21)
    theirs = far.call("snapshot")
    with kvmove.Agent("near", cache) as near:
        peer = connect(near, far)
        assert far.call("peers") == ["near"] and near.peer_path(peer) == "mapped"
        batches = [(list(range(8 * i, 8 * i + 8)), list(range(63 - 8 * i, 55 - 8 * i, -1)),
                    f"batch-{i}".encode()) for i in range(6)]
        batches += [(ids[::-1], remote[::-1], n + b"-again") for ids, remote, n in batches]
        seen: list[tuple[bytes, np.ndarray]] = []

        def gather() -> None:
            for _ in batches:
                _, payload = near.wait_notification(WAIT)
                remote = next(r for _, r, n in batches if n == payload)
                seen.append((payload, raw_view(cache)[:, remote].copy()))

        gatherer = threading.Thread(target=gather)
        gatherer.start()
        far.call("write_many", "near", batches)
        gatherer.join(WAIT)
        assert [p for p, _ in seen] == [n for _, _, n in batches]  # in posting order
        for (local, _, _), (_, rows) in zip(batches, seen):
            np.testing.assert_array_equal(rows, theirs[:, local])


def test_killed_peer_fails_transfers_and_its_mapping_is_released():
    """SIGKILL the far process with 1 GB of copies posted: every wait ends well before its
    deadline, DONE (copied before the death was noticed) or PeerError naming the peer; the
    next transfer is refused with PeerError; the peer's memfd leaves this process's maps."""
    cache = make_cache(BIG_LAYOUT, NUM_BLOCKS)
    doomed = FarPeer("doomed", BIG_LAYOUT, NUM_BLOCKS, {})
    near = kvmove.Agent("near", cache)
    try:
        peer = connect(near, doomed)
        assert near.peer_path(peer) == "mapped"
        theirs = segment_inode(doomed.call("metadata"), near.key)
        assert theirs in memfd_inodes()
        ids = list(range(NUM_BLOCKS))
        transfers = [near.write(peer, ids, ids) for _ in range(8)]
        os.kill(doomed.pid, signal.SIGKILL)
        start = time.monotonic()
        failed = 0
        for t in transfers:
            try:
                t.wait(30)
            except PeerError as e:
                assert "doomed" in str(e)
                failed += 1
            assert time.monotonic() - start < DEATH_DEADLINE
        assert failed > 0 or all(t.state == kvmove.TransferState.DONE for t in transfers)
        with pytest.raises(PeerError, match="doomed"):
            while time.monotonic() - start < DEATH_DEADLINE:  # refused once death is known
                near.write(peer, [0], [0]).wait(WAIT)
                time.sleep(0.01)
        while theirs in memfd_inodes() and time.monotonic() - start < DEATH_DEADLINE:
            time.sleep(0.01)
        assert theirs not in memfd_inodes()
        near.remove_peer(peer)
    finally:
        near.close()
        doomed.kill()
        doomed.stop()


@pytest.mark.parametrize("side", ["near", "far", "both"])
def test_either_side_can_refuse_the_mapping(side):
    """same_host="ucx" on either agent: UCX carries the transfer, byte for byte."""
    near_kwargs = {"same_host": "ucx"} if side in ("near", "both") else {}
    far_kwargs = {"same_host": "ucx"} if side in ("far", "both") else {}
    cache = make_cache(LAYOUT, NUM_BLOCKS)
    mine = fill(cache, 4)
    peer_proc = FarPeer("far", LAYOUT, NUM_BLOCKS, far_kwargs)
    try:
        with kvmove.Agent("near", cache, **near_kwargs) as near:
            peer = connect(near, peer_proc)
            assert near.peer_path(peer) == "ucx"
            near.write(peer, list(range(16)), list(range(16, 32))).wait(WAIT)
            np.testing.assert_array_equal(peer_proc.call("snapshot")[:, 16:32], mine[:, :16])
    finally:
        peer_proc.stop()


def test_metadata_naming_another_file_is_not_mapped():
    """A memfd (st_dev, st_ino) that is not the file at /proc/<pid>/fd/<fd> (a reused pid or
    fd number) is never mapped: the peer is reached over UCX instead."""
    a_cache, b_cache = make_cache(LAYOUT, 8), make_cache(LAYOUT, 8)
    with kvmove.Agent("a", a_cache) as a, kvmove.Agent("b", b_cache) as b:
        fields = wire.parse(b.key.verify(b.metadata()))
        fields["segments"][0]["memfd_ino"] += 1
        assert a.add_peer(a.key.sign(wire.build(fields))) == "b"
        assert a.peer_path("b") == "ucx"
        assert b.add_peer(a.metadata()) == "a"
        assert b.peer_path("a") == "mapped"  # the genuine metadata maps, in one process too


def test_wrapped_engine_memory_is_not_offered():
    """A wrapped engine tensor is no memfd: its metadata offers no mapping (memfd -1)."""
    layout = kvmove.KVSpec(2, 2, 16, block_size=4)
    tensors = [np.zeros((4, 2, 4, 2, 16), np.float16) for _ in range(2)]
    cache = kvmove.KVCache.wrap(tensors, layout=layout, block_dim=0, kv_dim=1)
    with kvmove.Agent("wrapped", cache) as agent:
        segments = _C.decode_metadata(agent.key.verify(agent.metadata()))["segments"]
        assert [s[3:] for s in segments] == [(-1, 0, 0)] * len(segments)


def test_reject_unknown_same_host_value():
    with pytest.raises(kvmove.errors.ConfigError, match="same_host must be one of"):
        kvmove.Agent("x", make_cache(LAYOUT, 2), same_host="shm")
