"""``kvmove.Agent`` (docs/transfer.md) on bad input and bad luck: every rejection path, one test
each, and peers that die mid-transfer.

Each rejection test checks three things: the exception class (``kvmove.errors``), that the
message names the offending value and the limit, and that nothing was posted or changed (the
far cache is as it was, and a valid transfer afterwards still works and lands exactly where it
should).

Most tests use two agents in this process, peers of each other through ``metadata()`` /
``add_peer()`` over UCX's tcp transport: validation happens before anything is posted, so one
process is enough and fast. Peer death needs a real process to kill: ``helpers.far.FarPeer``
spawns it.

No test may hang: every wait has a deadline, and calls that could block without one run in a
daemon thread through :func:`within`.
"""

from __future__ import annotations

import builtins
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.errors import (
    BlockError,
    ConfigError,
    KVMoveError,
    MetadataError,
    PeerError,
    TimeoutError,
    UCXError,
)

from helpers.checks import names, within
from helpers.far import FarPeer
from helpers.kv import make_cache, raw_view
from helpers.wire import HEADER, build, parse

# 4 layers, 2 KV heads x 16 dims, float16, 4 tokens per block: 512 B per block per layer.
LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
NUM_LAYERS = 4
A_BLOCKS = 16  # the near agent's cache
B_BLOCKS = 12  # the far agent's: smaller, so remote ids are checked against the peer's size
WAIT = 10.0    # deadline of every wait that should succeed, seconds
TCP = {"transports": "tcp", "error_mode": "peer"}


def free_port() -> int:
    """A loopback TCP port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Two agents in this process.

class Pair:
    """Agent ``a`` (16 blocks of random bytes) and agent ``b`` (12 zero blocks), peers of each
    other over tcp; ``a_ref`` / ``b_ref`` are copies of what their caches must still hold."""

    def __init__(self) -> None:
        self.a_cache, self.b_cache = make_cache(LAYOUT, A_BLOCKS), make_cache(LAYOUT, B_BLOCKS)
        raw_view(self.a_cache)[...] = np.random.default_rng(7).integers(
            0, 256, size=raw_view(self.a_cache).shape, dtype=np.uint8)
        self.a = kvmove.Agent("a", self.a_cache, **TCP)
        self.b = kvmove.Agent("b", self.b_cache, **TCP)
        assert self.a.add_peer(self.b.metadata()) == "b"
        assert self.b.add_peer(self.a.metadata()) == "a"
        self.a_ref, self.b_ref = raw_view(self.a_cache).copy(), raw_view(self.b_cache).copy()
        self.a_free, self.b_free = self.a_cache.pool.num_free, self.b_cache.pool.num_free

    def assert_untouched(self) -> None:
        """Nothing a rejected call could have posted arrived: a valid write afterwards (its
        flush orders everything before it on the endpoint) lands exactly, with its
        notification, and the caches are otherwise as they were."""
        t = self.a.write("b", [3], [5], notify=b"after")
        t.wait(WAIT)
        assert t.state == kvmove.TransferState.DONE
        assert self.b.wait_notification(WAIT) == ("a", b"after")
        assert self.b.notifications() == []
        assert self.a.notifications() == []
        expected = self.b_ref.copy()
        expected[:, 5] = self.a_ref[:, 3]
        np.testing.assert_array_equal(raw_view(self.b_cache), expected)
        np.testing.assert_array_equal(raw_view(self.a_cache), self.a_ref)
        assert self.a_cache.pool.num_free == self.a_free
        assert self.b_cache.pool.num_free == self.b_free

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


class Forger:
    """A peerless agent, and a key holder who signs whatever bytes it is given: its add_peer
    hands the core's decoder exactly those bytes. The decoder must stand on its own, whoever
    signed (the signature itself is tests/test_security.py's)."""

    def __init__(self, agent: kvmove.Agent) -> None:
        self.agent = agent

    def add_peer(self, blob: bytes) -> str:
        return self.agent.add_peer(self.agent.key.sign(bytes(blob)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.agent, name)


@pytest.fixture(scope="module")
def lone() -> Iterator[Forger]:
    """A peerless agent that only decodes metadata (module-scoped for hypothesis)."""
    with kvmove.Agent("lone", make_cache(LAYOUT, A_BLOCKS), **TCP) as agent:
        yield Forger(agent)


@pytest.fixture(scope="module")
def valid_metadata() -> Iterator[bytes]:
    """The core's metadata (unsigned) of a live agent named "meta-src" (8 blocks)."""
    with kvmove.Agent("meta-src", make_cache(LAYOUT, 8), **TCP) as agent:
        yield agent.key.verify(agent.metadata())


# ---------------------------------------------------------------------------------------------
# Construction.

def test_reject_unknown_error_mode():
    with pytest.raises(ConfigError, match="error_mode") as excinfo:
        kvmove.Agent("x", make_cache(LAYOUT, A_BLOCKS), error_mode="loud")
    names(excinfo, "'loud'", "'peer'", "'none'")


@pytest.mark.parametrize("cache", [np.zeros(16, dtype=np.uint8), None, "cache"],
                         ids=["ndarray", "None", "str"])
def test_reject_a_cache_that_is_not_a_kvcache(cache):
    with pytest.raises(ConfigError, match="cache must be a kvmove.KVCache") as excinfo:
        kvmove.Agent("x", cache)
    names(excinfo, type(cache).__name__)


def test_reject_empty_name():
    cache = make_cache(LAYOUT, A_BLOCKS)
    with pytest.raises(ConfigError, match="name") as excinfo:
        kvmove.Agent("", cache, **TCP)
    names(excinfo, "got 0", "255")
    _assert_cache_still_usable(cache)


@pytest.mark.parametrize("name", ["a" * 256, "é" * 128], ids=["256-ascii", "128-chars-256-bytes"])
def test_reject_name_over_255_bytes(name):
    """The limit is in bytes (the metadata's length prefix is one byte), not characters."""
    cache = make_cache(LAYOUT, A_BLOCKS)
    with pytest.raises(ConfigError, match="name") as excinfo:
        kvmove.Agent(name, cache, **TCP)
    names(excinfo, "got 256", "255")
    _assert_cache_still_usable(cache)


def test_name_of_exactly_255_bytes_is_accepted_by_a_peer():
    with kvmove.Agent("n" * 255, make_cache(LAYOUT, A_BLOCKS), **TCP) as a, \
            kvmove.Agent("other", make_cache(LAYOUT, A_BLOCKS), **TCP) as b:
        assert b.add_peer(a.metadata()) == "n" * 255


@pytest.mark.parametrize("name", ["dé", "tab\there", "nl\n"], ids=["non-ascii", "tab", "newline"])
def test_reject_name_no_peer_would_accept(name):
    """The docstring says "1..255 printable bytes", and decode() rejects any other byte, so an
    agent with such a name is unreachable: every peer's add_peer raises MetadataError. The
    constructor must reject the name (ConfigError naming it) instead of building that agent."""
    try:
        agent = kvmove.Agent(name, make_cache(LAYOUT, A_BLOCKS), **TCP)
    except ConfigError as e:
        assert "name" in str(e) and "printable" in str(e), str(e)
        return
    with agent, kvmove.Agent("other", make_cache(LAYOUT, A_BLOCKS), **TCP) as other:
        with pytest.raises(MetadataError):
            other.add_peer(agent.metadata())
    pytest.fail(f"Agent({name!r}) was created, but no peer can add it (MetadataError)")


@pytest.mark.parametrize("timeout", [0.0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
def test_reject_non_positive_peer_timeout(timeout):
    cache = make_cache(LAYOUT, A_BLOCKS)
    with pytest.raises(ConfigError, match="peer_timeout must be positive") as excinfo:
        kvmove.Agent("x", cache, peer_timeout=timeout, **TCP)
    names(excinfo, f"got {timeout:g}")
    _assert_cache_still_usable(cache)


def test_reject_infinite_peer_timeout():
    """peer_timeout=inf passes the `> 0` check and reaches UCX as "infs", which UCX refuses with
    "Invalid parameter": the error must be a ConfigError that names peer_timeout and its
    value, not a UCXError about "transports ''"."""
    with pytest.raises(ConfigError, match="peer_timeout") as excinfo:
        kvmove.Agent("x", make_cache(LAYOUT, A_BLOCKS), peer_timeout=float("inf"), **TCP)
    names(excinfo, "inf")


@pytest.mark.parametrize("transports", ["nonexistent_tl", ["nonexistent_tl"]], ids=["str", "list"])
def test_reject_transports_ucx_does_not_have(transports):
    """UCX has no transport of that name: ucp_init fails ("No such device") and the message
    names what was asked for."""
    cache = make_cache(LAYOUT, A_BLOCKS)
    with pytest.raises(UCXError, match="nonexistent_tl") as excinfo:
        kvmove.Agent("x", cache, transports=transports, error_mode="peer")
    assert isinstance(excinfo.value, KVMoveError)
    _assert_cache_still_usable(cache)


def _assert_cache_still_usable(cache: kvmove.KVCache) -> None:
    """A failed construction left nothing behind: the cache registers again and moves bytes."""
    free = cache.pool.num_free
    with kvmove.Agent("retry", cache, **TCP) as a, \
            kvmove.Agent("retry-peer", make_cache(LAYOUT, cache.num_blocks), **TCP) as b:
        a.add_peer(b.metadata())
        a.write("retry-peer", [0], [1]).wait(WAIT)
    assert cache.pool.num_free == free


# ---------------------------------------------------------------------------------------------
# Metadata: every malformed blob is a MetadataError (a PeerError and a ValueError), no crash.
#
# Wire format: csrc/transport/metadata.h (helpers/wire.py builds blobs field by field).

def test_metadata_codec_round_trips(valid_metadata):
    """The test-side parse/build matches the library's format exactly."""
    fields = parse(valid_metadata)
    assert fields["name"] == b"meta-src" and fields["num_blocks"] == 8
    assert build(fields) == valid_metadata


def test_reject_empty_metadata(lone):
    with pytest.raises(MetadataError, match="bad agent metadata") as excinfo:
        lone.add_peer(b"")
    names(excinfo, "0 bytes", "KVMV")
    assert lone.peers == []


@pytest.mark.parametrize("seed", range(4))
def test_reject_random_bytes(lone, seed):
    junk = np.random.default_rng(seed).integers(0, 256, size=64 * (seed + 1),
                                                dtype=np.uint8).tobytes()
    with pytest.raises(MetadataError, match="not kvmove metadata") as excinfo:
        lone.add_peer(junk)
    names(excinfo, f"{len(junk)} bytes")
    assert lone.peers == []


def test_metadata_error_is_a_peer_error_and_a_value_error(lone):
    with pytest.raises(MetadataError) as excinfo:
        lone.add_peer(b"nope")
    assert isinstance(excinfo.value, PeerError)
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, KVMoveError)


def test_reject_every_truncation(lone, valid_metadata):
    for n in range(len(valid_metadata)):
        with pytest.raises(MetadataError, match="bad agent metadata") as excinfo:
            lone.add_peer(valid_metadata[:n])
        message = str(excinfo.value)
        assert "truncated" in message or "no KVMV magic" in message, (n, message)
    assert lone.peers == []


def test_reject_every_single_bit_flip(lone, valid_metadata):
    """A flipped bit in the magic, version, reserved field or length is caught by its own
    check, one anywhere in the body or checksum by the checksum: nothing reaches UCX."""
    for bit in range(len(valid_metadata) * 8):
        blob = bytearray(valid_metadata)
        blob[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(MetadataError, match="bad agent metadata"):
            lone.add_peer(bytes(blob))
    assert lone.peers == []


def test_reject_checksum_mismatch(lone, valid_metadata):
    blob = bytearray(valid_metadata)
    blob[HEADER.size + 2] ^= 0x20  # inside the name
    with pytest.raises(MetadataError, match="checksum mismatch"):
        lone.add_peer(bytes(blob))


def test_reject_wrong_magic(lone, valid_metadata):
    with pytest.raises(MetadataError, match="no KVMV magic") as excinfo:
        lone.add_peer(b"NIXL" + valid_metadata[4:])
    names(excinfo, f"{len(valid_metadata)} bytes")


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 0xFFFF])
def test_reject_wrong_version(lone, valid_metadata, version):
    blob = valid_metadata[:4] + struct.pack("<H", version) + valid_metadata[6:]
    with pytest.raises(MetadataError, match="format version") as excinfo:
        lone.add_peer(blob)
    names(excinfo, f"version {version}", "reads 5")


@pytest.mark.parametrize("suffix", [b"\0", b"KVMV", b"x" * 100], ids=["1", "4", "100"])
def test_reject_trailing_bytes(lone, valid_metadata, suffix):
    with pytest.raises(MetadataError, match="after the checksum") as excinfo:
        lone.add_peer(valid_metadata + suffix)
    names(excinfo, f"{len(suffix)} bytes")


def test_reject_metadata_concatenated_twice(lone, valid_metadata):
    with pytest.raises(MetadataError, match="after the checksum"):
        lone.add_peer(valid_metadata * 2)


# Fields forged with a correct checksum: each field check must hold on its own. A case is the
# fields to set, or a function that edits the parsed fields (segments and planes are records).
def _segment0(**change: Any) -> Callable[[dict[str, Any]], None]:
    return lambda f: f["segments"][0].update(change)


def _plane(i: int, **change: Any) -> Callable[[dict[str, Any]], None]:
    return lambda f: f["planes"][i].update(change)


def _halve_planes(f: dict[str, Any]) -> None:
    for plane in f["planes"]:
        plane["block_nbytes"] //= 2


FORGED: dict[str, tuple[Any, str]] = {
    "empty-name": ({"name": b""}, r"name is 0 bytes, must be in \[1, 255\]"),
    "control-byte-in-name": ({"name": b"a\x07b"}, "name has non-printable byte 7"),
    "empty-worker-address": ({"worker_address": b""},
                             r"worker_address is 0 bytes, must be in \[1,"),
    "empty-rkey": (_segment0(packed_rkey=b""), r"packed_rkey is 0 bytes, must be in \[1,"),
    "no-segments": ({"segments": []}, r"num_segments is 0, must be in \[1, 8192\]"),
    "empty-segment": (_segment0(nbytes=0), "segment 0 of 0 bytes at 0x[0-9a-f]+ is empty"),
    "segment-past-2^64": (_segment0(addr=2**64 - 16), "overflows 64 bits"),
    "zero-layers": ({"num_layers": 0, "planes": []}, r"num_layers is 0, must be in \[1, 4096\]"),
    "4097-layers": ({"num_layers": 4097}, r"num_layers is 4097, must be in \[1, 4096\]"),
    "2^31-blocks": ({"num_blocks": 2**31},
                    r"num_blocks is 2147483648, must be in \[1, 2147483647\]"),
    "three-parts": ({"num_parts": 3}, r"num_parts is 3, must be in \[1, 2\]"),
    "plane-outside-its-segment": (_plane(3, base=None),
                                  r"plane 3 \(layer 3\) spans .* outside its segment"),
    "plane-in-a-missing-segment": (_plane(0, segment=1), "plane 0 is in segment 1 of 1"),
    "stride-below-the-block": (_plane(0, block_stride=1), "need a block stride >= that"),
    "plane-end-past-2^64": (_plane(0, block_stride=2**62), "overflow 64 bits"),
    "blocks-not-the-shape": (_halve_planes, r"planes hold \d+ B per block and layer, the shape"),
    "zero-heads": ({"num_kv_heads": 0}, r"num_kv_heads is 0, must be in \[1,"),
    "zero-head-dim": ({"head_dim": 0}, r"head_dim is 0, must be in \[1,"),
    "zero-block-size": ({"block_size": 0}, r"block_size is 0, must be in \[1,"),
    "empty-dtype": ({"dtype": b""}, r"dtype is 0 bytes, must be in \[1, 32\]"),
    "33-byte-dtype": ({"dtype": b"f" * 33}, r"dtype is 33 bytes, must be in \[1, 32\]"),
    "unknown-order": ({"order": b"NDH"}, "unknown order 'NDH'"),
    "empty-order": ({"order": b""}, r"order is 0 bytes, must be in \[1, 32\]"),
    "zero-total-heads": ({"total_kv_heads": 0}, r"total_kv_heads is 0, must be in \[1,"),
    "heads-past-the-total": ({"head_first": 1}, r"KV heads \[1, \d+\) are not among "
                                                r"total_kv_heads \d+"),
    "head-first-past-2^31": ({"head_first": 2**32 - 1}, r"KV heads \[4294967295, "),
    "reserved-not-zero": ({"reserved": 1}, "reserved field is not 0"),
    "control-byte-in-boot-id": ({"boot_id": b"ab\ncd"}, "boot_id has non-printable byte 10"),
    "65-byte-boot-id": ({"boot_id": b"b" * 65}, r"boot_id is 65 bytes, must be in \[0, 64\]"),
    "memfd-below-minus-1": (_segment0(memfd=-2), "segment 0 has memfd -2"),
    "no-memfd-but-an-inode": (_segment0(memfd=-1, memfd_dev=0, memfd_ino=7),
                              "segment 0 has memfd -1 .must be -1, with dev and ino 0"),
}


@pytest.mark.parametrize("case", FORGED, ids=list(FORGED))
def test_reject_forged_field_with_valid_checksum(lone, valid_metadata, case):
    changes, pattern = FORGED[case]
    fields = parse(valid_metadata)
    if callable(changes):
        changes(fields)
    else:
        fields.update(changes)
    for plane in fields["planes"]:
        if plane["base"] is None:  # one byte past its segment's end
            plane["base"] = fields["segments"][0]["addr"] + fields["segments"][0]["nbytes"] - \
                (fields["num_blocks"] - 1) * plane["block_stride"] - plane["block_nbytes"] + 1
    with pytest.raises(MetadataError, match=pattern):
        lone.add_peer(build(fields))
    assert lone.peers == []


def test_reject_trailing_bytes_inside_the_body(lone, valid_metadata):
    with pytest.raises(MetadataError, match="bad agent metadata: 3 trailing bytes"):
        lone.add_peer(build(parse(valid_metadata), body_suffix=b"abc"))


@pytest.mark.parametrize("body_nbytes", [0, 4 * 65536 + 1, 0xFFFFFFFF])
def test_reject_body_length_out_of_range(lone, valid_metadata, body_nbytes):
    blob = valid_metadata[:8] + struct.pack("<I", body_nbytes) + valid_metadata[12:]
    with pytest.raises(MetadataError, match=r"body is \d+ bytes, must be in \[1, 262144\]") as e:
        lone.add_peer(blob)
    names(e, f"body is {body_nbytes} bytes")


# Mutations of a valid blob. Every result that differs from the blob is invalid: a different
# length fails the length checks (truncated / bytes after the checksum), and a same-length
# change alters the magic, version, reserved field, length, body or checksum, each of which is
# checked (the body against a 64-bit checksum). The test assumes the result differs.
_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 16)),
)


def mutate(blob: bytes, mutations: list[tuple[str, int, Any]]) -> bytes:
    out = bytearray(blob)
    for kind, pos, arg in mutations:
        if kind == "set" and out:
            out[pos % len(out)] = arg
        elif kind == "insert":
            p = pos % (len(out) + 1)
            out[p:p] = arg
        elif kind == "delete" and out:
            p = pos % len(out)
            del out[p:p + arg]
    return bytes(out)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_reject_mutated_metadata(lone, valid_metadata, mutations):
    blob = mutate(valid_metadata, mutations)
    assume(blob != valid_metadata)
    with pytest.raises(MetadataError, match="bad agent metadata"):
        lone.add_peer(blob)
    assert lone.peers == []


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=600), header=st.booleans())
def test_reject_arbitrary_bytes(lone, junk, header):
    """Arbitrary bytes, optionally behind a valid magic and version so they reach the
    length, checksum and field checks."""
    blob = (b"KVMV\x01\x00\x00\x00" + junk) if header else junk
    with pytest.raises(MetadataError, match="bad agent metadata"):
        lone.add_peer(blob)
    assert lone.peers == []


def test_agent_decodes_valid_metadata_after_all_that_junk(lone, valid_metadata):
    """No rejected blob left a half-added peer behind."""
    assert lone.add_peer(valid_metadata) == "meta-src"
    assert lone.peers == ["meta-src"]
    lone.remove_peer("meta-src")
    assert lone.peers == []


# ---------------------------------------------------------------------------------------------
# Adding peers.

def test_reject_adding_a_peer_twice(pair):
    with pytest.raises(PeerError, match="already added") as excinfo:
        pair.a.add_peer(pair.b.metadata())
    assert not isinstance(excinfo.value, MetadataError)
    names(excinfo, "'b'", "'a'")
    assert pair.a.peers == ["b"]
    pair.assert_untouched()


def test_reject_adding_the_same_peer_twice(pair):
    with pytest.raises(PeerError, match="peer 'b' is already added"):
        pair.a.add_peer(pair.b.metadata())
    assert pair.a.peers == ["b"]
    pair.assert_untouched()


def test_another_incarnation_of_a_peer_replaces_it(pair):
    """A peer that comes back under its name with new metadata (it restarted: another
    incarnation) replaces the old one, even before the old one was noticed dead (NIXL #1986:
    the survivor must not need a restart). Transfers to the name now reach the new agent, and
    the old one's blocks are left alone. Whether the newcomer may join at all is the
    deployment key's business (docs/security.md), not the name's."""
    with kvmove.Agent("b", make_cache(LAYOUT, A_BLOCKS), **TCP) as again:
        assert again.incarnation != pair.b.incarnation
        assert pair.a.add_peer(again.metadata()) == "b"
        again.add_peer(pair.a.metadata())
        assert pair.a.peers == ["b"]
        pair.a.write("b", [3], [5], notify=b"new").wait(WAIT)
        assert again.wait_notification(WAIT) == ("a", b"new")
        np.testing.assert_array_equal(raw_view(again.cache)[:, 5], pair.a_ref[:, 3])
    np.testing.assert_array_equal(raw_view(pair.b_cache), pair.b_ref)
    assert pair.b.notifications() == []


@pytest.mark.parametrize("same_host", ["ucx", "map"])
def test_a_side_that_dropped_the_other_reconnects_on_fresh_endpoints(same_host):
    """Issue 28, row 2: "b" removes "a" (as a receiver disconnects a silent sender) while
    "a" still holds its endpoint to "b", alive as far as "a" can tell. "b" connects again:
    both sides take fresh endpoints (they used to keep "a"'s old one, and every message
    between the old endpoint and the new was dropped as no peer's). Messages and data then
    flow both ways."""
    kwargs = {**TCP, "same_host": same_host}
    a_cache, b_cache = make_cache(LAYOUT, A_BLOCKS), make_cache(LAYOUT, B_BLOCKS)
    raw_view(a_cache)[:, 2] = 7
    with kvmove.Agent("a", a_cache, **kwargs) as a, kvmove.Agent("b", b_cache, **kwargs) as b:
        address = a.listen("127.0.0.1")
        assert b.connect(*address) == "a"
        b.remove_peer("a")
        assert a.peers == ["b"]  # "a" cannot tell
        assert b.connect(*address) == "a"
        a.send("b", b"after").wait(WAIT)
        assert b.wait_notification(WAIT) == ("a", b"after")
        a.write("b", [2], [5], notify=b"data").wait(WAIT)
        assert b.wait_notification(WAIT) == ("a", b"data")
        assert (raw_view(b_cache)[:, 5] == 7).all()
        assert b.stats().unknown_senders == 0 and a.stats().unknown_senders == 0


def test_an_agent_can_add_itself():
    """Decided from the implementation: nothing forbids it. add_peer(own metadata) makes a UCX
    loopback endpoint to the agent's own worker; transfers to "itself" are local copies, and
    notifications arrive in its own queue."""
    cache = make_cache(LAYOUT, A_BLOCKS)
    raw_view(cache)[:, 0] = 42
    with kvmove.Agent("self", cache, **TCP) as agent:
        assert agent.add_peer(agent.metadata()) == "self"
        assert agent.peers == ["self"]
        agent.write("self", [0], [1], notify=b"me").wait(WAIT)
        assert agent.wait_notification(WAIT) == ("self", b"me")
        assert (raw_view(cache)[:, 1] == 42).all()
        with pytest.raises(BlockError, match="destination block 2 appears twice"):
            agent.write("self", [0, 1], [2, 2])  # still validated like any peer


def test_add_peer_of_a_closed_agent_is_a_peer_error():
    """Stale metadata (its agent has closed) points to a tcp address nobody listens on:
    ucp_ep_create fails with "Destination is unreachable". errors.py: PeerError is for a peer
    that is "unknown, unreachable, dead", so that is the class, and the message names the
    peer; nothing is added."""
    with kvmove.Agent("a", make_cache(LAYOUT, A_BLOCKS), **TCP) as a:
        gone = kvmove.Agent("gone", make_cache(LAYOUT, A_BLOCKS), **TCP)
        stale = gone.metadata()
        gone.close()
        with pytest.raises(PeerError) as excinfo:
            a.add_peer(stale)
        names(excinfo, "'gone'")
        assert a.peers == []


# ---------------------------------------------------------------------------------------------
# write / read validation. "op" covers both directions where the rule is the same.

OPS = ["write", "read"]


@pytest.mark.parametrize("op", OPS)
def test_reject_unknown_peer(pair, op):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        getattr(pair.a, op)("nobody", [0], [0])
    names(excinfo, "'nobody'", "'a'")
    pair.assert_untouched()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("local,remote", [([0, 1], [0]), ([0], [0, 1]), ([], [0])])
def test_reject_length_mismatch(pair, op, local, remote):
    with pytest.raises(ConfigError, match="cannot pair") as excinfo:
        getattr(pair.a, op)("b", local, remote)
    names(excinfo, f"{len(local)} local", f"{len(remote)} remote", "'b'")
    pair.assert_untouched()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [-1, A_BLOCKS, 2**40], ids=["negative", "num_blocks", "huge"])
def test_reject_local_id_out_of_range(pair, op, bad):
    with pytest.raises(BlockError, match="local block") as excinfo:
        getattr(pair.a, op)("b", [0, bad], [0, 1])
    names(excinfo, f"block {bad}", f"[0, {A_BLOCKS})")
    pair.assert_untouched()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", [-1, B_BLOCKS, A_BLOCKS - 1], ids=["negative", "peer-num_blocks",
                                                                    "valid-here-not-there"])
def test_reject_remote_id_out_of_range(pair, op, bad):
    """Remote ids are checked against the peer's num_blocks (12), not this agent's (16)."""
    with pytest.raises(BlockError, match="of 'b' is out of range") as excinfo:
        getattr(pair.a, op)("b", [0, 1], [0, bad])
    names(excinfo, f"block {bad}", f"[0, {B_BLOCKS})")
    pair.assert_untouched()


def test_reject_write_with_duplicate_destination(pair):
    with pytest.raises(BlockError, match="destination block 3 appears twice"):
        pair.a.write("b", [0, 1, 2], [3, 4, 3])
    pair.assert_untouched()


def test_reject_read_with_duplicate_destination(pair):
    with pytest.raises(BlockError, match="destination block 7 appears twice"):
        pair.a.read("b", [7, 8, 7], [0, 1, 2])
    pair.assert_untouched()


def test_write_with_duplicate_sources_is_allowed(pair):
    """One local block to several remote ones: reading a block twice races with nothing."""
    pair.a.write("b", [2, 2, 9], [0, 1, 11]).wait(WAIT)
    expected = pair.b_ref.copy()
    expected[:, [0, 1, 11]] = pair.a_ref[:, [2, 2, 9]]
    np.testing.assert_array_equal(raw_view(pair.b_cache), expected)


def test_read_with_duplicate_sources_is_allowed(pair):
    raw_view(pair.b_cache)[:, 4] = 0x5A
    pair.a.read("b", [0, 1], [4, 4]).wait(WAIT)
    assert (raw_view(pair.a_cache)[:, [0, 1]] == 0x5A).all()
    np.testing.assert_array_equal(raw_view(pair.a_cache)[:, 2:], pair.a_ref[:, 2:])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layers", [[NUM_LAYERS], [-1], [0, 1, 99]], ids=["4", "-1", "99"])
def test_reject_layer_out_of_range(pair, op, layers):
    bad = next(layer for layer in layers if not 0 <= layer < NUM_LAYERS)
    with pytest.raises(ConfigError, match="layer") as excinfo:
        getattr(pair.a, op)("b", [0], [0], layers=layers)
    names(excinfo, f"layer {bad}", f"[0, {NUM_LAYERS})")
    pair.assert_untouched()


# Each field that must agree, with this side's value and the peer's (dtype: same width, so
# only the field comparison can tell them apart).
LAYOUT_FIELDS = {
    "num_kv_heads": (2, 4),
    "head_dim": (16, 8),
    "dtype": ("float16", "bfloat16"),
    "block_size": (4, 8),
    "num_layers": (4, 3),
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("field", LAYOUT_FIELDS)
def test_reject_layout_mismatch(op, field):
    here, there = LAYOUT_FIELDS[field]
    a_cache, c_cache = make_cache(LAYOUT, A_BLOCKS), make_cache({**LAYOUT, field: there}, A_BLOCKS)
    before = raw_view(c_cache).copy()
    with kvmove.Agent("a", a_cache, **TCP) as a, kvmove.Agent("c", c_cache, **TCP) as c:
        raw_view(a_cache)[...] = 0x33
        assert a.add_peer(c.metadata()) == "c"  # layouts are compared per transfer
        with pytest.raises(ConfigError, match="KV layouts differ") as excinfo:
            getattr(a, op)("c", [0], [0], notify=b"no")
        names(excinfo, f"{field}: {here} here, {there} at 'c'")
        time.sleep(0.2)  # nothing was posted, so nothing can arrive late either
        np.testing.assert_array_equal(raw_view(c_cache), before)
        assert (raw_view(a_cache) == 0x33).all()
        assert c.notifications() == []


@pytest.mark.parametrize("op", OPS)
def test_reject_notification_over_64_kib(pair, op):
    with pytest.raises(ConfigError, match="notification") as excinfo:
        getattr(pair.a, op)("b", [0], [0], notify=b"x" * (64 * 1024 + 1))
    names(excinfo, "65537 bytes", "65536")
    pair.assert_untouched()


@pytest.mark.parametrize("op", OPS)
def test_notification_of_exactly_64_kib_is_delivered(pair, op):
    payload = bytes(range(256)) * 256
    assert len(payload) == 64 * 1024
    getattr(pair.a, op)("b", [0], [0], notify=payload).wait(WAIT)
    assert pair.b.wait_notification(WAIT) == ("a", payload)


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), 1e7],
                         ids=["negative", "nan", "infinite", "beyond-limit"])
def test_reject_bad_transfer_wait(pair, timeout):
    """Every wait has a deadline: negative, NaN, infinite and absurd timeouts are misuse."""
    t = pair.a.write("b", [0], [0])
    with pytest.raises(ConfigError, match=r"timeout must be in \[0, 1e\+06\] seconds") as excinfo:
        t.wait(timeout)
    names(excinfo, f"got {timeout:g}")
    t.wait(WAIT)  # the transfer itself is unaffected
    assert t.state == kvmove.TransferState.DONE


def test_reject_negative_notification_wait(pair):
    with pytest.raises(ConfigError, match=r"timeout must be in \[0, 1e\+06\] seconds") as excinfo:
        pair.b.wait_notification(-1)
    names(excinfo, "got -1")
    pair.assert_untouched()


def test_wait_notification_times_out(pair):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no notification") as excinfo:
        pair.b.wait_notification(0.5)
    elapsed = time.monotonic() - start
    assert 0.4 < elapsed < 0.5 + 2
    assert isinstance(excinfo.value, builtins.TimeoutError)
    names(excinfo, "'b'", "0.5 s")
    pair.assert_untouched()


def test_close_wakes_a_waiting_wait_notification():
    """The wait's predicate checks `closed_` and the timeout message says "(agent closed)",
    but close() never notifies the condition variable: a thread in wait_notification(3)
    sleeps its full 3 s after close(). It should wake at once with TimeoutError."""
    agent = kvmove.Agent("sleepy", make_cache(LAYOUT, A_BLOCKS), **TCP)
    start = time.monotonic()
    closer = threading.Timer(0.2, agent.close)
    closer.start()
    try:
        with pytest.raises(TimeoutError, match="agent closed"):
            within(10, agent.wait_notification, 3.0)
        assert time.monotonic() - start < 2.0, "close() did not wake wait_notification"
    finally:
        closer.join()
        agent.close()


# ---------------------------------------------------------------------------------------------
# Lifecycle: close, remove_peer, listen, connect.

@pytest.mark.parametrize("op", OPS)
def test_reject_transfer_after_close(pair, op):
    pair.a.close()
    with pytest.raises(ConfigError, match="closed") as excinfo:
        getattr(pair.a, op)("b", [0], [0])
    names(excinfo, "'a'")
    np.testing.assert_array_equal(raw_view(pair.b_cache), pair.b_ref)
    np.testing.assert_array_equal(raw_view(pair.a_cache), pair.a_ref)


def test_reject_add_peer_after_close(pair):
    pair.a.close()
    with pytest.raises(ConfigError, match="agent 'a' is closed"):
        pair.a.add_peer(pair.b.metadata())


def test_close_twice_is_fine(pair):
    pair.a.close()
    pair.a.close()
    with pair.b:
        pass
    pair.b.close()
    assert pair.a.peers == [] and pair.b.peers == []


def test_reject_listen_after_close(pair):
    """A closed agent must not serve its metadata: a peer that connects would add an agent
    whose worker is gone."""
    pair.a.close()
    with pytest.raises(ConfigError, match="closed"):
        pair.a.listen()


def test_reject_removing_an_unknown_peer(pair):
    with pytest.raises(PeerError, match="unknown peer") as excinfo:
        pair.a.remove_peer("nobody")
    names(excinfo, "'nobody'", "'a'")
    assert pair.a.peers == ["b"]
    pair.assert_untouched()


@pytest.mark.parametrize("op", OPS)
def test_reject_transfer_to_a_removed_peer(pair, op):
    pair.a.remove_peer("b")
    assert pair.a.peers == []
    with pytest.raises(PeerError, match="unknown peer 'b'"):
        getattr(pair.a, op)("b", [0], [0])
    with pytest.raises(PeerError, match="unknown peer 'b'"):
        pair.a.remove_peer("b")
    np.testing.assert_array_equal(raw_view(pair.b_cache), pair.b_ref)
    # It can come back: an exchange both ways, as connect() does. (b still holds its old
    # connection to a, and messages are known by their connection: one way is not enough.)
    assert pair.a.add_peer(pair.b.metadata()) == "b"
    pair.b.remove_peer("a")
    assert pair.b.add_peer(pair.a.metadata()) == "a"
    pair.assert_untouched()


def test_reject_listening_twice(pair):
    host, port = pair.a.listen()
    with pytest.raises(ConfigError, match="already listens") as excinfo:
        pair.a.listen()
    names(excinfo, "'a'", port)
    # the first listener still serves
    with kvmove.Agent("c", make_cache(LAYOUT, A_BLOCKS), **TCP) as c:
        assert c.connect(host, port, timeout=WAIT) == "a"


def test_connect_to_a_port_nobody_listens_on(pair):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(PeerError, match="no metadata answer") as excinfo:
        within(10, pair.a.connect, "127.0.0.1", port, timeout=1.0)
    assert time.monotonic() - start < 5
    names(excinfo, f"127.0.0.1:{port}", "1.0 s")
    assert pair.a.peers == ["b"]
    pair.assert_untouched()


@pytest.mark.parametrize("timeout", [-1.0, float("nan")], ids=["negative", "nan"])
def test_reject_bad_connect_timeout(pair, timeout):
    """connect(timeout=-1) reaches zmq as poll(-1000), which means "wait forever": to a port
    nobody listens on it never returns. timeout=nan fails in int() with a bare ValueError.
    Either must be a ConfigError naming the value."""
    port = free_port()
    box: dict[str, BaseException] = {}

    def connect() -> None:
        try:
            pair.a.connect("127.0.0.1", port, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - checked below
            box["error"] = e

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(2)
    stuck = thread.is_alive()
    if stuck:
        # Answer it so the thread ends before the fixture closes the agent under it: zmq
        # reconnects to this listener by itself.
        with kvmove.Agent("unstick", make_cache(LAYOUT, A_BLOCKS), **TCP) as rescuer:
            rescuer.listen(port=port)
            thread.join(5)
    assert not stuck, f"connect(timeout={timeout}) to a port nobody listens on never returned"
    assert isinstance(box.get("error"), ConfigError), repr(box.get("error"))
    message = str(box["error"])
    assert "timeout" in message and f"{timeout:g}" in message, message


def test_listener_rejecting_our_metadata_is_a_peer_error():
    """The listener rejects metadata it cannot add (here: it has ``max_peers`` already): it
    answers "ER" + its error, and the connecting agent raises PeerError with that message.
    Neither side changed."""
    with kvmove.Agent("full", make_cache(LAYOUT, A_BLOCKS), max_peers=1, **TCP) as full, \
            kvmove.Agent("first", make_cache(LAYOUT, A_BLOCKS), **TCP) as first, \
            kvmove.Agent("odd", make_cache(LAYOUT, A_BLOCKS), **TCP) as other:
        host, port = full.listen()
        first.connect(host, port, timeout=WAIT)
        with pytest.raises(PeerError, match="rejected our metadata") as excinfo:
            other.connect(host, port, timeout=WAIT)
        names(excinfo, f"{host}:{port}", "its limit (max_peers)", "'odd'")
        assert other.peers == []
        assert full.peers == ["first"]


def test_connecting_again_to_a_listener_that_already_added_us(pair):
    """A connect whose answer never arrived (it timed out on our side after the listener
    added us) must not lock us out: the listener answers the same run of us again, keeps the
    peer as it was, and we become its peer."""
    host, port = pair.a.listen()
    with kvmove.Agent("again", make_cache(LAYOUT, A_BLOCKS), **TCP) as other:
        pair.a.add_peer(other.metadata())   # as if our first connect's answer got lost
        assert other.connect(host, port, timeout=WAIT) == "a"
        assert other.connect(host, port, timeout=WAIT) == "a"   # and once more
        assert sorted(pair.a.peers) == ["again", "b"]
        assert other.peers == ["a"]
        other.read("a", [0], [1]).wait(WAIT)   # the kept endpoint works
        pair.a.remove_peer("again")
    pair.assert_untouched()


def test_listener_survives_junk_requests(pair):
    """Whatever arrives on the side channel, the listener answers "ER" + the MetadataError and
    keeps serving: unsigned bytes are refused before the decoder sees them."""
    host, port = pair.a.listen()
    ctx = zmq.Context()
    try:
        for junk in [b"", b"junk", b"KVMV" + b"\0" * 40, b"KVMS" + b"\0" * 80]:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
            sock.send(junk)
            assert sock.poll(int(WAIT * 1000)), "listener did not answer"
            reply = sock.recv()
            sock.close()
            assert reply.startswith(b"ER") and b"not signed" in reply, reply
    finally:
        ctx.term()
    assert pair.a.peers == ["b"]
    with kvmove.Agent("c", make_cache(LAYOUT, A_BLOCKS), **TCP) as c:
        assert c.connect(host, port, timeout=WAIT) == "a"
    pair.assert_untouched()


# ---------------------------------------------------------------------------------------------
# Peer death: the far agent is a real process, SIGKILLed with transfers in flight.

# llama-3.1-8b: 32 layers x 16 tokens x 4 KiB = 2 MiB per block; 250 blocks = 500 MiB a cache,
# so several transfers of every block take seconds over tcp loopback and are surely in flight
# when the peer dies a few milliseconds after they are posted. These tests are about UCX's
# failure detection, so both sides keep UCX (same_host="ucx"): mapped copies may well finish
# before a death is noticed (test_peer_mapping.py covers a death on that path).
BIG_LAYOUT = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
BIG_BLOCKS = 250
NUM_TRANSFERS = 4
DEATH_DEADLINE = 10.0  # a dead peer's transfers must fail well before their 30 s wait


@contextmanager
def doomed_peer(name: str, error_mode: str,
                transports: str | None = "tcp") -> Iterator[tuple[int, str, int]]:
    """A far agent in a spawned process, listening: yields ``(pid, host, port)``. The process
    is always dead and joined afterwards."""
    far = FarPeer(name, BIG_LAYOUT, BIG_BLOCKS, {"transports": transports, "error_mode": error_mode,
                                                 "same_host": "ucx"})
    try:
        yield (far.pid, *far.call("listen"))
    finally:
        far.kill()
        far.stop()


def post_and_kill(near: kvmove.Agent, op: str, peer: str, pid: int) -> list[kvmove.Transfer]:
    ids = list(range(BIG_BLOCKS))
    transfers = [getattr(near, op)(peer, ids, ids) for _ in range(NUM_TRANSFERS)]
    assert [t.state for t in transfers] == [kvmove.TransferState.PENDING] * NUM_TRANSFERS
    os.kill(pid, signal.SIGKILL)
    return transfers


@pytest.mark.parametrize("op", OPS)
def test_killed_peer_fails_every_transfer_in_flight(op):
    """SIGKILL the far process with 2 GB of writes (or reads) in flight: every transfer fails
    with PeerError naming the peer long before its deadline, state FAILED, `error` set; a new
    transfer to the dead peer is refused at once; this side's cache and pool are untouched
    (kvmove allocates nothing for the caller) and the agent closes cleanly."""
    cache = kvmove.KVCache(kvmove.KVSpec(**BIG_LAYOUT), BIG_BLOCKS)
    free = cache.pool.num_free
    near = kvmove.Agent("near", cache, transports="tcp", error_mode="peer", same_host="ucx")
    try:
        with doomed_peer("doomed", "peer") as (pid, host, port):
            assert near.connect(host, port, timeout=WAIT) == "doomed"
            transfers = post_and_kill(near, op, "doomed", pid)
            start = time.monotonic()
            for t in transfers:
                with pytest.raises(PeerError, match="transfer with 'doomed' failed"):
                    t.wait(30)
                assert time.monotonic() - start < DEATH_DEADLINE
            for t in transfers:
                assert t.state == kvmove.TransferState.FAILED
                assert t.error != ""
                assert t.peer == "doomed"
            start = time.monotonic()
            with pytest.raises(PeerError, match="peer 'doomed' failed"):
                getattr(near, op)("doomed", [0], [0])
            assert time.monotonic() - start < 1.0
            assert near.peers == ["doomed"]  # dead, but still known: remove_peer forgets it
            near.remove_peer("doomed")
            assert cache.pool.num_free == free
    finally:
        within(15, near.close)
    assert near.peers == []


def transports_to_far(near_kwargs: dict) -> set[str]:
    """The UCX transports a near agent made with ``near_kwargs`` reaches a default far agent
    in another process with."""
    far = FarPeer("far", LAYOUT, A_BLOCKS, {})
    near = kvmove.Agent("near", make_cache(LAYOUT, A_BLOCKS), **near_kwargs)
    try:
        assert near.connect(*far.call("listen"), timeout=WAIT) == "far"
        return {tl for tl, _ in near.peer_transports("far")}
    finally:
        near.close()
        far.stop()


def test_default_transports_on_one_host_are_shared_memory_and_cma():
    """The default (error_mode="peer", UCX's choice of transports) reaches a peer on this host
    through shared memory for messages and cma for the data, not tcp loopback: kvmove's UCX
    settings for PEER mode (docs/transfer.md, "Error mode")."""
    transports = transports_to_far({})
    assert "cma" in transports
    assert transports & {"sysv", "posix"}
    assert "tcp" not in transports


@pytest.mark.parametrize("near_kwargs", [{"transports": "tcp"}, {"error_mode": "none"}],
                         ids=["tcp", "none"])
def test_peer_transports_follow_the_agent_config(near_kwargs):
    """transports="tcp" gives tcp alone; error_mode="none" shared memory and cma as well."""
    transports = transports_to_far(near_kwargs)
    if near_kwargs.get("transports") == "tcp":
        assert transports == {"tcp"}
    else:
        assert "cma" in transports and "tcp" not in transports


def test_a_ucx_setting_in_the_environment_overrides_kvmoves(monkeypatch):
    """An expert's UCX_MM_ERROR_HANDLING=n wins over kvmove's PEER-mode default: shared memory
    then cannot report a dead peer, so UCX sends messages over tcp loopback."""
    monkeypatch.setenv("UCX_MM_ERROR_HANDLING", "n")
    transports = transports_to_far({})
    assert "tcp" in transports
    assert not transports & {"sysv", "posix"}


def test_peer_transports_of_an_unknown_peer_is_a_peer_error():
    with kvmove.Agent("alone", make_cache(LAYOUT, A_BLOCKS), **TCP) as agent:
        with pytest.raises(PeerError, match="unknown peer 'ghost'"):
            agent.peer_transports("ghost")


def test_killed_peer_on_this_host_is_reported_over_shared_memory():
    """The default transports between two processes on one host are shared memory and cma
    (docs/transfer.md, "Error mode"), and peer-failure detection still works over them: after
    a SIGKILL, transfers to the peer fail with PeerError naming it, long before their deadline
    (cma's copy into a process that is gone fails; sysv's keepalive checks the peer's pid),
    and then new ones are refused at once."""
    near = kvmove.Agent("near", kvmove.KVCache(kvmove.KVSpec(**BIG_LAYOUT), BIG_BLOCKS),
                        same_host="ucx")  # UCX's shared memory, not the mapped path
    try:
        with doomed_peer("doomed", "peer", transports=None) as (pid, host, port):
            assert near.connect(host, port, timeout=WAIT) == "doomed"
            assert "tcp" not in [tl for tl, _ in near.peer_transports("doomed")]
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(PeerError, match="doomed"):
                while time.monotonic() - start < DEATH_DEADLINE:
                    near.write("doomed", [0], [0]).wait(30)
            assert time.monotonic() - start < DEATH_DEADLINE
            with pytest.raises(PeerError, match="peer 'doomed' failed"):
                near.write("doomed", [0], [0])
    finally:
        within(15, near.close)


def test_failed_transfer_error_names_the_dead_peer():
    """`Transfer.error` depends on which UCX callback runs first: on_peer_error writes
    "peer 'doomed' failed: UCX reported ...", but a flush that fails first writes only
    "UCX reported Connection reset by remote peer" (or "Endpoint timeout"). The exception from
    wait() names the peer either way; `error` should too, every time."""
    near = kvmove.Agent("near", kvmove.KVCache(kvmove.KVSpec(**BIG_LAYOUT), BIG_BLOCKS),
                        transports="tcp", error_mode="peer", same_host="ucx")
    try:
        with doomed_peer("doomed", "peer") as (pid, host, port):
            assert near.connect(host, port, timeout=WAIT) == "doomed"
            transfers = post_and_kill(near, "write", "doomed", pid)
            for t in transfers:
                with pytest.raises(PeerError):
                    t.wait(30)
            errors = [t.error for t in transfers]
            assert all("doomed" in e for e in errors), f"errors without the peer: {errors}"
    finally:
        within(15, near.close)


def test_killed_peer_with_error_mode_none_does_not_hang():
    """Without UCX's peer-failure mode nothing promises a PeerError, but a wait still ends at
    its deadline (TimeoutError) or earlier (PeerError when tcp reports the reset); the
    agent still closes."""
    cache = kvmove.KVCache(kvmove.KVSpec(**BIG_LAYOUT), BIG_BLOCKS)
    near = kvmove.Agent("near-none", cache, transports="tcp", error_mode="none", same_host="ucx")
    try:
        with doomed_peer("doomed-none", "none") as (pid, host, port):
            assert near.connect(host, port, timeout=WAIT) == "doomed-none"
            transfers = post_and_kill(near, "write", "doomed-none", pid)
            start = time.monotonic()
            for t in transfers:
                with pytest.raises((TimeoutError, PeerError), match="doomed-none"):
                    t.wait(2)
            assert time.monotonic() - start < 2 * NUM_TRANSFERS + 2
    finally:
        within(15, near.close)


def test_an_agent_dropped_without_close_takes_its_listener_with_it():
    """The listener thread must not keep an abandoned agent (its UCX worker, its thread)
    alive: it holds the agent weakly, and stops when the agent is collected."""
    import gc
    import threading
    import weakref

    before = threading.active_count()
    agent = kvmove.Agent("abandoned", kvmove.KVCache(kvmove.KVSpec(2, 1, 8), 4),
                         transports="tcp")
    agent.listen()
    ref = weakref.ref(agent)
    del agent
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ref() is None
    assert threading.active_count() <= before
