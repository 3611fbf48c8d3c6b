"""Issue 15's review, finding by finding (docs/security.md): what an attacker did then, and
that it fails now. Each test is named after its finding's number in the review's table.

The HTTP and router findings (6, 9, and the server's part of 8) are tested against a real
``kvmove-serve`` in tests/test_serve_control.py and tests/test_serve_http.py; the sanitizer
build and the fuzz targets (finding 13's other half) run in ``.ci/hardening``.

The agents here share this user's host key (the default) unless a test gives one another key:
a "stranger" is an agent of another deployment, an "impostor" one that holds the key but was
never added by the agent it talks to.
"""

from __future__ import annotations

import gc
import json
import math
import secrets
import select
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove import _C, StreamState
from kvmove.auth import DeploymentKey, resolve_key
from kvmove.bootstrap import (
    MAX_EXCHANGES_PER_SECOND,
    MAX_MESSAGE_BYTES,
    MAX_REFUSALS_PER_SECOND,
    ListenerStats,
    MetadataServer,
)
from kvmove.errors import ConfigError, MetadataError, PeerError

from helpers.checks import WORKDIR, listening_addresses, names, wait_while_rising
from helpers.kv import make_cache, raw_view
from helpers.serve import wait_until
from helpers.wire import build, parse

LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
NUM_BLOCKS = 16
WAIT = 10.0
TCP = {"transports": "tcp"}
FLOOD = Path(__file__).parent / "helpers" / "flood.py"


def agent(name: str, **kwargs) -> kvmove.Agent:
    return kvmove.Agent(name, make_cache(LAYOUT, NUM_BLOCKS), **{**TCP, **kwargs})


def stranger_key() -> bytes:
    return secrets.token_bytes(32)


class Pair:
    """Agents "a" and "b", peers of each other; a's cache holds random bytes."""

    def __init__(self) -> None:
        self.a, self.b = agent("a"), agent("b")
        raw_view(self.a.cache)[...] = np.random.default_rng(1).integers(
            0, 256, size=raw_view(self.a.cache).shape, dtype=np.uint8)
        self.a.add_peer(self.b.metadata())
        self.b.add_peer(self.a.metadata())

    def assert_serving(self) -> None:
        """a still writes to b, exactly, with its notification."""
        t = self.a.write("b", [2], [9], notify=b"still here")
        t.wait(WAIT)
        assert self.b.wait_notification(WAIT) == ("a", b"still here")
        np.testing.assert_array_equal(raw_view(self.b.cache)[:, 9], raw_view(self.a.cache)[:, 2])

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


def zmq_request(address: tuple[str, int], message: bytes, wait_ms: int) -> bytes | None:
    """Sends ``message`` to a metadata listener as a raw ZeroMQ REQ; its answer, or None."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address[0]}:{address[1]}")
        sock.send(message)
        return sock.recv() if sock.poll(wait_ms) else None
    finally:
        ctx.destroy(linger=0)


# --- 1: anyone reaching listen() became a peer ------------------------------------------------

def test_finding_1_an_agent_without_the_key_is_refused_by_a_listener(pair):
    """The review's stranger connected and then read and wrote the victim's KV. Now its
    metadata is refused before the victim's core sees it, it never learns the victim's
    metadata (so it has nothing to reach the memory with), and the victim's peers are as
    they were."""
    address = pair.a.listen()
    with agent("thief", key=stranger_key()) as thief:
        with pytest.raises(PeerError, match="not signed with this deployment's key"):
            thief.connect(*address, timeout=WAIT)
        assert thief.peers == []
        # Metadata that leaked some other way is no use either: it is signed for others.
        with pytest.raises(MetadataError, match="not signed with this deployment's key"):
            thief.add_peer(pair.a.metadata())
    assert pair.a.peers == ["b"]
    pair.assert_serving()


def test_finding_1_a_key_holder_joins(pair):
    """The same connect with the deployment's key works both ways: the key is the only
    difference."""
    address = pair.a.listen()
    with agent("friend", key=pair.a.key.secret) as friend:
        assert friend.connect(*address, timeout=WAIT) == "a"
        assert "friend" in pair.a.peers
        t = friend.write("a", [0], [5], notify=b"hi")
        t.wait(WAIT)
        assert pair.a.wait_notification(WAIT) == ("friend", b"hi")


def test_finding_1_listening_beyond_loopback_needs_a_deployment_key(monkeypatch, tmp_path):
    """The host key proves only "same user, this host": an agent refuses to listen on another
    interface with it, and says what to do."""
    for name in ("KVMOVE_KEY", "KVMOVE_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    with agent("wide", host="0.0.0.0") as wide:
        assert wide.key.host_only
        with pytest.raises(ConfigError, match="only the host key") as excinfo:
            wide.listen()
        names(excinfo, "'0.0.0.0'", "KVMOVE_KEY")
    with agent("wide-keyed", host="0.0.0.0", key=secrets.token_bytes(16)) as keyed:
        # bound to every interface, it tells peers an address they can reach, never the
        # wildcard (peers told "0.0.0.0" connected to themselves); tests/test_two_hosts.py
        # checks it is the one reached, and the refusal without a route
        host, port = keyed.listen(port=0)
        assert host not in ("0.0.0.0", "") and keyed.listen_address == (host, port)
        assert ("0.0.0.0", port) in listening_addresses()


def test_the_advertised_address_is_the_one_named_and_never_a_wildcard():
    key = secrets.token_bytes(16)
    with agent("named", host="0.0.0.0", key=key) as named:
        assert named.listen(advertise="10.1.2.3")[0] == "10.1.2.3"
    with agent("wild", host="0.0.0.0", key=key) as wild:
        with pytest.raises(ConfigError, match="cannot advertise the wildcard '0.0.0.0'"):
            wild.listen(advertise="0.0.0.0")
        assert wild.listen_address is None


def test_finding_1_the_host_key_is_private_to_its_user(monkeypatch, tmp_path):
    """Made once, 0600 in a 0700 folder, the same for every agent of the user; one that others
    can read is refused, naming the fix; short keys are refused."""
    for name in ("KVMOVE_KEY", "KVMOVE_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    first, second = resolve_key(), resolve_key()
    assert first == second and first.host_only and len(first.secret) == 32
    path = tmp_path / "kvmove" / "host.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert "secret" not in repr(first) and first.secret.hex() not in repr(first)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others") as excinfo:
        resolve_key()
    names(excinfo, "chmod 600")
    with pytest.raises(ConfigError, match="at least 16 bytes") as excinfo:
        resolve_key(b"short")
    names(excinfo, "got 5")
    monkeypatch.setenv("KVMOVE_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot read KVMOVE_KEY_FILE"):
        resolve_key()


# --- 2: forged region_addr wrote outside the region over tcp ---------------------------------

def test_finding_2_metadata_with_a_forged_region_is_refused(pair):
    """The review's forger pointed the region (now: its segment and planes) at another buffer
    of the victim's process. The forged blob (re-checksummed, so the core's own checks pass)
    is refused by the signature when signed with any key but the deployment's, before the
    core or UCX reads it."""
    fields = parse(pair.b.key.verify(pair.b.metadata()))
    victim_buffer = np.full(4096, 0x11, dtype=np.uint8)
    segment = {**fields["segments"][0], "addr": victim_buffer.ctypes.data}
    plane = {**fields["planes"][0], "base": victim_buffer.ctypes.data}
    forged = build({**fields, "name": b"forger", "started_ns": fields["started_ns"] + 1,
                    "segments": [segment], "planes": [plane] * len(fields["planes"])})
    for key in (stranger_key(), None):
        signed = DeploymentKey(key, "argument").sign(forged) if key else forged
        with pytest.raises(MetadataError, match="signed"):
            pair.a.add_peer(signed)
    assert pair.a.peers == ["b"]
    assert (victim_buffer == 0x11).all()
    pair.assert_serving()


# --- 3: mutated + re-checksummed metadata crashed UCX; one ZeroMQ message aborted a listener --

@settings(max_examples=200, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), min_size=1,
                      max_size=8),
       field=st.sampled_from(["worker_address", "packed_rkey"]))
def test_finding_3_mutated_and_rechecksummed_metadata_never_reaches_ucx(flips, field):
    """The review's crashing inputs: bytes of the UCX address or remote key flipped, the
    checksum recomputed. Signed by a stranger they are all refused by the signature (a
    crash would end the test run); this module's own agent keeps working."""
    victim = _VICTIM.agent
    fields = parse(victim.key.verify(victim.metadata()))
    owner = fields["segments"][0] if field == "packed_rkey" else fields
    blob = bytearray(owner[field])
    for pos, xor in flips:
        blob[pos % len(blob)] ^= xor
    owner[field] = bytes(blob)
    forged = build({**fields, "name": b"mutant"})
    with pytest.raises(MetadataError, match="not signed with this deployment's key"):
        victim.add_peer(DeploymentKey(_VICTIM.stranger, "argument").sign(forged))
    assert victim.peers == []


class _Victim:
    """One agent for the hypothesis test above (built once: agents take ~10 ms each)."""

    def __init__(self) -> None:
        self._agent: kvmove.Agent | None = None
        self.stranger = stranger_key()

    @property
    def agent(self) -> kvmove.Agent:
        if self._agent is None or self._agent.closed:
            self._agent = agent("victim")
        return self._agent


_VICTIM = _Victim()


def test_finding_3_junk_on_the_side_channel_is_answered_and_the_listener_keeps_serving(pair):
    """The review aborted a listening agent with one ZeroMQ message. Every kind of junk is now
    answered with an error, and a real connect afterwards works."""
    address = pair.a.listen()
    fields = parse(pair.a.key.verify(pair.a.metadata()))
    fields["worker_address"] = bytes(len(fields["worker_address"]))
    junk = [b"", b"\xff" * 7, b"KVMV" + b"\0" * 60, b"KVMS" + b"\0" * 200,
            build(fields), DeploymentKey(stranger_key(), "argument").sign(build(fields))]
    for message in junk:
        reply = zmq_request(address, message, int(WAIT * 1000))
        assert reply is not None and reply.startswith(b"ER"), (message[:16], reply)
    assert pair.a.peers == ["b"]
    with agent("late") as late:
        assert late.connect(*address, timeout=WAIT) == "a"
    pair.assert_serving()


def test_finding_3_a_listener_whose_add_peer_breaks_still_answers_and_keeps_serving():
    """Not from the review: an unexpected exception (not a KVMoveError) in the listener's
    add_peer used to end its thread, and every later connect went unanswered."""
    calls: list[bytes] = []

    def add_peer(metadata: bytes) -> str:
        calls.append(metadata)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return "peer"

    server = MetadataServer(b"own", lambda signed: signed, add_peer)
    try:
        first = zmq_request(server.address, b"first", int(WAIT * 1000))
        assert first is not None and first.startswith(b"ER internal error: RuntimeError"), first
        assert zmq_request(server.address, b"second", int(WAIT * 1000)) == b"OKown"
        assert calls == [b"first", b"second"]
    finally:
        server.close()


# --- 4: active messages were attributed by the name in their header --------------------------

def test_finding_4_an_agent_named_like_a_peer_cannot_finish_its_load():
    """The review's impostor, named "prefill-0" and never added by the decode side, completed
    a load with its own payload. Its messages now come from an endpoint that is no peer's:
    dropped and counted, and the real prefill's stream completes exactly."""
    decode, prefill, impostor = agent("decode-0"), agent("prefill-0"), agent("prefill-0")
    try:
        raw_view(prefill.cache)[...] = 7
        decode.add_peer(prefill.metadata())
        prefill.add_peer(decode.metadata())
        impostor.add_peer(decode.metadata())  # one way: decode never added it
        load = decode.expect("prefill-0", "r", [4, 5]).start_load()
        fake = impostor.stream_to("decode-0", [0, 1], [4, 5], "r", epoch=load.epoch)
        for layer in range(LAYOUT["num_layers"]):
            fake.save_layer(layer)
        fake.finish(b"forged payload")
        t = impostor.write("decode-0", [], [], notify=b"forged notification")
        t.wait(WAIT)
        wait_until(lambda: decode.stats().unknown_senders >= 2, WAIT,
                   lambda: f"impostor's messages not seen: {decode.stats()}")
        assert load.state == StreamState.OPEN and decode.notifications() == []
        assert not fake._core.answered, "the impostor was told Go"
        assert (raw_view(decode.cache)[:, [4, 5]] == 0).all(), "the impostor wrote"

        real = prefill.stream_to("decode-0", [0, 1], [4, 5], "r", epoch=load.epoch)
        for layer in range(LAYOUT["num_layers"]):
            real.save_layer(layer)
        real.finish(b"real payload")
        real.wait_for_save(WAIT)
        assert load.wait_all(WAIT) == b"real payload"
        assert (raw_view(decode.cache)[:, [4, 5]] == 7).all()
    finally:
        for a in (impostor, prefill, decode):
            a.close()


# --- 5: a 3-byte Final payload killed the decode worker ---------------------------------------

def test_finding_5_a_bad_final_payload_ends_its_request_not_the_worker():
    """A prefill (here a bare agent) ends its stream with a 3-byte payload, then with the
    8-byte first token of the engine's old format, where the decode worker expects its
    32-byte final payload (first token, the prefill's last-layer time, its boot id): each such
    request ends with an error naming the size, its blocks come back, and the worker serves
    the next request."""
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
    from kvmove.engine.request import FinishReason, Request, SamplingParams
    from kvmove.engine.worker import EngineWorker

    model = LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0)
    decode = EngineWorker(model, role="decode", name="d", num_blocks=16, block_size=16,
                          agent_kwargs=TCP)
    sender = kvmove.Agent("p", kvmove.KVCache(model.config.kv_spec(16), 16), **TCP)
    try:
        decode.agent.add_peer(sender.metadata())
        sender.add_peer(decode.agent.metadata())
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        final = struct.pack("<qd16s", 5, math.nan, bytes(16))  # no time, no boot id
        for payload, ok in ((b"abc", False), (struct.pack("<q", 5), False), (final, True)):
            request = Request(f"r{len(payload)}", list(range(1, 20)), params)
            ids = decode.reserve(request)
            decode.start_load(request, "p")
            offer = sender.wait_offer(WAIT)
            assert (offer.request_id, offer.blocks) == (request.id, tuple(ids))
            stream = sender.stream_to("d", ids, offer.blocks, request.id, epoch=offer.epoch)
            for layer in range(model.config.num_layers):
                stream.save_layer(layer)
            stream.finish(payload)
            stream.wait_for_save(WAIT)
            deadline = time.monotonic() + WAIT
            while request.finish_reason is None:
                decode.step()
                assert time.monotonic() < deadline, "the request never ended"
            if ok:
                assert request.finish_reason is FinishReason.LENGTH
                assert request.output[0] == 5 and len(request.output) == 3
            else:
                assert request.finish_reason is FinishReason.ABORT
                assert f"{len(payload)}-byte final payload, not 32" in request.error
        assert decode.cache.pool.num_free == 16
    finally:
        sender.close()
        decode.close()


# --- 7: rendezvous active messages were read as if they were data ----------------------------

def test_finding_7_rendezvous_messages_are_dropped():
    """A peer that sends its notifications and stream messages as rendezvous (the fault
    ``rndv_messages`` makes one): the receiver drops each, counts it, and never reads the
    descriptor as a message; the sender is not left hanging."""
    odd, b = agent("odd", faults="rndv_messages=1"), agent("b")
    try:
        odd.add_peer(b.metadata())
        b.add_peer(odd.metadata())
        t = odd.write("b", [1], [1], notify=b"x" * 100)
        t.wait(WAIT)
        load = b.expect("odd", "r", [2]).start_load()
        stream = odd.stream_to("b", [3], [2], "r", epoch=load.epoch)
        wait_until(lambda: b.stats().messages_dropped >= 2, WAIT, lambda: str(b.stats()))
        assert b.notifications() == [] and not stream._core.answered
        assert odd.faults_injected()["rndv_message"] >= 2
        load.cancel()
    finally:
        odd.close()
        b.close()


# --- 8: unbounded queues, payloads, peers, messages -------------------------------------------

def test_finding_8_a_peers_unclaimed_notifications_are_capped(pair):
    """A peer may not fill our memory with notifications nobody takes: past 1024 queued from
    it, the rest are dropped and counted; taken ones make room again."""
    cap = 1024
    transfers = [pair.a.write("b", [], [], notify=b"n%d" % i) for i in range(cap + 50)]
    for t in transfers:
        t.wait(WAIT)
    wait_until(lambda: pair.b.stats().messages_dropped == 50, WAIT, lambda: str(pair.b.stats()))
    queued = pair.b.notifications()
    assert len(queued) == cap and queued[0] == ("a", b"n0") and queued[-1] == ("a", b"n1023")
    pair.assert_serving()


def test_finding_8_final_payloads_are_bounded(pair):
    """A Final's payload is at most 64 KiB: the sender refuses more, and a receiver's decoder
    refuses a message that carries more."""
    load = pair.b.expect("a", "r", [1]).start_load()
    stream = pair.a.stream_to("b", [1], [1], "r", epoch=load.epoch)
    for layer in range(LAYOUT["num_layers"]):
        stream.save_layer(layer)
    with pytest.raises(ConfigError, match="exceeds the limit") as excinfo:
        stream.finish(b"x" * (64 * 1024 + 1))
    names(excinfo, 64 * 1024 + 1, 64 * 1024)
    stream.finish(b"x" * 64 * 1024)
    stream.wait_for_save(WAIT)
    assert load.wait_all(WAIT) == b"x" * 64 * 1024
    big = _C.encode_stream_message("Final", "r", 1, payload=b"x" * (64 * 1024 + 1))
    with pytest.raises(MetadataError, match="payload of 65537 bytes, limit 65536"):
        _C.decode_stream_message(big)


def test_finding_8_an_agent_takes_at_most_max_peers():
    with agent("hub", max_peers=2) as hub, agent("p1") as p1, agent("p2") as p2, \
            agent("p3") as p3:
        hub.add_peer(p1.metadata())
        hub.add_peer(p2.metadata())
        with pytest.raises(PeerError, match="max_peers") as excinfo:
            hub.add_peer(p3.metadata())
        names(excinfo, "2 peers", "'p3'")
        hub.remove_peer("p1")
        assert hub.add_peer(p3.metadata()) == "p3"
    with pytest.raises(ConfigError, match="max_peers"):
        agent("none", max_peers=0)


def test_finding_8_the_side_channel_bounds_message_size_and_rate(pair):
    """Over MAX_MESSAGE_BYTES, ZeroMQ drops the message (no answer, nothing read). From one
    source, signed exchanges past MAX_EXCHANGES_PER_SECOND are answered "busy" before
    add_peer, and unsigned ones past MAX_REFUSALS_PER_SECOND go unanswered; the listener
    counts each kind, and serves a real connect afterwards."""
    address = pair.a.listen()
    assert zmq_request(address, b"\0" * (MAX_MESSAGE_BYTES + 1), 1000) is None
    # Three seconds' worth of each at once, from as many sockets.
    signed = pair.a.key.sign(b"junk")  # passes the signature, then add_peer refuses it
    replies = zmq_burst(address, [signed] * (3 * MAX_EXCHANGES_PER_SECOND), WAIT)
    busy = sum(r is not None and r.startswith(b"ER busy") for r in replies)
    assert None not in replies and 0 < busy < len(replies), (busy, replies[:2])
    # Another source (127.0.0.2 is loopback too) has a whole budget of its own.
    other = zmq_burst(address, [signed] * len(replies), WAIT, source="127.0.0.2")
    other_busy = sum(r is not None and b"busy" in r for r in other)
    assert None not in other and len(other) - other_busy >= MAX_EXCHANGES_PER_SECOND, other_busy
    junk = zmq_burst(address, [b"junk"] * (3 * MAX_REFUSALS_PER_SECOND), 1.0)
    answered = [r for r in junk if r is not None]
    assert 0 < len(answered) < len(junk), answered
    assert all(b"not signed kvmove metadata" in r for r in answered), answered
    assert pair.a.listener_stats() == ListenerStats(
        joined=0, refused=2 * len(replies) - busy - other_busy, busy=busy + other_busy,
        unsigned=len(junk),
        dropped=len(junk) - len(answered))
    time.sleep(1.1)
    with agent("late") as late:
        assert late.connect(*address, timeout=WAIT) == "a"
    assert pair.a.listener_stats().joined == 1


def zmq_burst(address: tuple[str, int], messages: list[bytes], seconds: float,
              source: str = "127.0.0.1") -> list[bytes | None]:
    """Each message from a REQ socket of its own (from the address ``source``), all sent
    before any answer is read; the answers, None for those not answered within ``seconds``."""
    ctx = zmq.Context()
    try:
        socks = [ctx.socket(zmq.REQ) for _ in messages]
        for sock, message in zip(socks, messages):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{source}:0;{address[0]}:{address[1]}")
            sock.send(message)
        deadline = time.monotonic() + seconds
        return [sock.recv() if sock.poll(max(0, int((deadline - time.monotonic()) * 1000)))
                else None for sock in socks]
    finally:
        ctx.destroy(linger=0)


def test_issue_28_a_keyless_flood_leaves_keyed_peers_a_way_in(pair):
    """Issue 28, row 3: a keyless flood (975k junk messages in 12 s) spent the listener's one
    budget of 100 exchanges a second, and 0 of 10 keyed connects got in. Input without the
    key is now refused by its signature before it costs an exchange, and budgets are per
    source: while another process floods the listener as fast as it takes messages, at least
    9 of 10 keyed connects get in, and the flood is counted and all but a trickle of it left
    unanswered."""
    address = pair.a.listen()
    began = time.monotonic()  # refusals are budgeted per second of flood, drain included
    flood = subprocess.Popen([sys.executable, str(FLOOD), *map(str, address)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdin is not None
        ready = select.select([flood.stdout], [], [], WAIT)[0]
        assert ready and flood.stdout.readline() == "flooding\n", "the flood never began"
        wait_until(lambda: pair.a.listener_stats().unsigned >= 1000, WAIT,
                   lambda: f"the flood has not reached the listener: {pair.a.listener_stats()}")
        started = time.monotonic()
        joined = 0
        with agent("keyed") as keyed:
            for _ in range(10):
                time.sleep(0.2)  # spread over 2 s of flood: more than one second's budget
                try:
                    joined += keyed.connect(*address, timeout=WAIT) == "a"
                except PeerError as error:
                    print(f"a keyed connect failed during the flood: {error}")
        seconds = time.monotonic() - started
        assert flood.poll() is None, "the flood ended before the connects did"
        flood.stdin.write("stop\n")
        flood.stdin.flush()
        assert select.select([flood.stdout], [], [], WAIT)[0], "the flood did not stop"
        sent = int(flood.stdout.readline())
        assert joined >= 9, f"{joined} of 10 keyed connects got in during the flood"
        # The flood holds its connections open until the listener has read all it sent:
        # tens of thousands of messages may still sit in the sockets' buffers, which a
        # listener under the sanitizers takes more than WAIT to read. It must keep reading.
        wait_while_rising(lambda: pair.a.listener_stats().unsigned, sent, WAIT)
        drained = time.monotonic()
        flood.communicate(timeout=WAIT)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait(WAIT)
    stats = pair.a.listener_stats()
    print(f"flood: {sent} messages sent; 10 connects took {seconds:.1f} s; {stats}")
    assert stats.unsigned == sent, (sent, stats)
    answered = stats.unsigned - stats.dropped
    # a bucket of one second's refusals, refilled at that rate while the flood lasted
    assert answered <= MAX_REFUSALS_PER_SECOND * (drained - began + 1), (drained - began, stats)
    assert (stats.joined, stats.busy, stats.refused) == (joined, 0, 0), stats
    pair.assert_serving()


# --- 10: unkeyed block hashes could be engineered to collide ----------------------------------

def test_finding_10_block_hashes_are_keyed_by_the_deployment():
    """With a deployment's seed, block hashes are a keyed chain: another key (or none) gives
    other hashes for the same tokens, the same key the same ones; the engine's prefix cache
    uses the seed it is given."""
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
    from kvmove.engine.request import Request, SamplingParams
    from kvmove.engine.scheduler import SchedulerConfig
    from kvmove.engine.worker import EngineWorker

    tokens = list(range(64))
    ours, theirs = DeploymentKey(b"k" * 32, "argument"), DeploymentKey(b"j" * 32, "argument")
    plain = kvmove.block_hashes(tokens, 16)
    keyed = kvmove.block_hashes(tokens, 16, seed=ours.hash_seed())
    assert keyed == kvmove.block_hashes(tokens, 16, seed=ours.hash_seed())
    assert not set(keyed) & set(plain)
    assert not set(keyed) & set(kvmove.block_hashes(tokens, 16, seed=theirs.hash_seed()))

    model = LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0)
    worker = EngineWorker(model, num_blocks=16, block_size=16,
                          scheduler=SchedulerConfig(hash_seed=ours.hash_seed()))
    request = Request("r", tokens + [1], SamplingParams(max_tokens=1, ignore_eos=True))
    worker.add_request(request)
    worker.run()
    cached = {worker.cache.pool.block_hash(i) for i in range(16)} - {None}
    assert set(keyed) <= cached and not cached & set(plain)


# --- 11: ids.h read a list that __index__ had changed -----------------------------------------

def test_finding_11_a_list_changed_while_it_is_read_is_read_as_it_was():
    """An id whose ``__index__`` empties and refills the list being converted: the ids are
    read from a copy taken before any Python ran, so the call sees the list as it was passed
    (under the sanitizer build, the old code's read of the freed items is a reported error)."""
    pool = kvmove.BlockPool(8)
    ids = pool.allocate(4)

    class Shifty:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            victim.clear()
            victim.extend(object() for _ in range(64))  # a new, larger items array
            gc.collect()
            return self.value

    victim = [ids[0], Shifty(ids[1]), ids[2], ids[3]]
    pool.free(victim)
    assert pool.num_free == 8 and len(victim) == 64


# --- 12: UCX's tcp sockets listened on every interface ----------------------------------------

def test_finding_12_an_agent_on_loopback_listens_only_on_loopback():
    """Every socket an agent opens to listen (UCX's tcp transport, the metadata listener) is
    on 127.0.0.1. The check can fail: the same agent on "0.0.0.0" listens more widely
    (where the machine has another interface). tests/test_two_hosts.py checks an agent on a
    veth address."""
    before = listening_addresses()
    with agent("local") as local:
        local.listen()
        opened = listening_addresses() - before
        assert opened and {host for host, _ in opened} == {"127.0.0.1"}, opened
    with agent("wide", host="0.0.0.0", key=secrets.token_bytes(16)) as wide:
        wide.listen()
        opened = listening_addresses() - before
        hosts = {host for host, _ in opened}
        assert "0.0.0.0" in hosts, opened
        if _other_interfaces():
            assert hosts - {"127.0.0.1", "0.0.0.0"}, f"UCX kept to loopback? {opened}"


def _other_interfaces() -> bool:
    """Whether an interface other than loopback is up here."""
    net = Path("/sys/class/net")
    return any(d.name != "lo" and (d / "operstate").read_text().strip() == "up"
               for d in net.iterdir())


# --- 13: the stream-message decoder could not be reached ---------------------------------------

KINDS = ["Begin", "Go", "Refuse", "Layer", "Final", "Ack", "Abort", "Cancel", "Offer",
         "Decline"]
VERSION = 4  # the stream message version (csrc/stream/stream_message.h)


@pytest.mark.parametrize("kind", KINDS)
def test_finding_13_stream_messages_round_trip(kind):
    checksums = [1, 2] if kind == "Layer" else []
    block_ids = [5, 2**62] if kind == "Offer" else []
    payload = b"why" if kind in ("Final", "Refuse", "Decline") else b""
    data = _C.encode_stream_message(kind, "req-1", 2**40 + 3, layer=7, ids_hash=99,
                                    checksums=checksums, payload=payload, block_ids=block_ids)
    decoded = _C.decode_stream_message(data)
    assert decoded == {"kind": kind, "request_id": "req-1", "epoch": 2**40 + 3, "layer": 7,
                       "ids_hash": 99, "checksums": checksums, "payload": payload,
                       "block_ids": block_ids}
    for cut in range(len(data)):  # every truncation is refused
        if cut < len(data) - len(payload) or not payload:
            with pytest.raises(MetadataError):
                _C.decode_stream_message(data[:cut])


@pytest.mark.parametrize("data, message", [
    (b"", "shorter than its 28-byte header"),
    (bytes([9]) + bytes(27), "version 9"),
    (bytes([2, 1]) + bytes(26), "version 2, this kvmove speaks 4"),
    (bytes([3, 1]) + bytes(26), "version 3, this kvmove speaks 4"),  # XXH64 checksums
    (bytes([VERSION, 0]) + bytes(26), "unknown stream message kind 0"),
    (bytes([VERSION, 11]) + bytes(26), "unknown stream message kind 11"),
    (bytes([VERSION, 1, 0, 0]) + bytes(24), "request id of 0 bytes"),
    (bytes([VERSION, 1, 0xff, 0xff]) + bytes(24), "request id of 65535 bytes"),
    (bytes([VERSION, 1, 1, 0]) + bytes(20) + struct.pack("<I", 1) + b"r" + bytes(8),
     "Begin message carries 1 values; only Layer and Offer may"),
    (bytes([VERSION, 4, 1, 0]) + bytes(20) + struct.pack("<I", 2**21) + b"r",
     "2097152 values, limit 1048576"),
    (bytes([VERSION, 4, 1, 0]) + bytes(20) + struct.pack("<I", 3) + b"r" + bytes(8),
     "too short for its 1-byte request id and 3 values"),
    (bytes([VERSION, 4, 1, 0]) + bytes(24) + b"r" + b"extra", "Layer message carries 5 payload"),
    (bytes([VERSION, 9, 1, 0]) + bytes(24) + b"r" + b"extra", "Offer message carries 5 payload"),
    (bytes([VERSION, 9, 1, 0]) + bytes(20) + struct.pack("<I", 1) + b"r" + struct.pack("<Q", 2**63),
     "Offer of block id 9223372036854775808"),
])
def test_finding_13_bad_stream_messages_name_what_is_wrong(data, message):
    with pytest.raises(MetadataError, match=message):
        _C.decode_stream_message(data)


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=200), keep_header=st.booleans())
def test_finding_13_arbitrary_stream_messages_decode_or_raise(data, keep_header):
    """Any bytes, optionally behind a valid version and kind: decoded, or a MetadataError."""
    if keep_header:
        data = bytes([VERSION, 1 + data[0] % len(KINDS)]) + data[2:] if len(data) >= 2 else data
    try:
        decoded = _C.decode_stream_message(data)
    except MetadataError:
        return
    assert _C.encode_stream_message(decoded["kind"], decoded["request_id"], decoded["epoch"],
                                    decoded["layer"], decoded["ids_hash"],
                                    decoded["checksums"], decoded["payload"],
                                    decoded["block_ids"]) == data


def test_finding_13_the_metadata_decoder_is_reachable():
    with agent("m") as a:
        decoded = _C.decode_metadata(a.key.verify(a.metadata()))
        assert decoded["name"] == "m" and decoded["num_blocks"] == NUM_BLOCKS
        assert decoded["incarnation"] == a.incarnation
    with pytest.raises(MetadataError, match="not kvmove metadata"):
        _C.decode_metadata(b"\0" * 40)


_LISTENERS = """
import json, sys
import numpy as np
import kvmove
sys.path.insert(0, sys.argv[2])
from helpers.checks import listening_addresses
from helpers.kv import make_cache, raw_view
layout = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
a, b = (kvmove.Agent(n, make_cache(layout, 4), transports=sys.argv[1], same_host="ucx")
        for n in "ab")
a.add_peer(b.metadata()); b.add_peer(a.metadata())
raw_view(a.cache)[...] = 7
a.write("b", [1], [2], notify=b"n").wait(10.0)
assert b.wait_notification(10.0) == ("a", b"n")
assert (raw_view(b.cache)[:, 2] == 7).all()
print(json.dumps({"listening": sorted(listening_addresses()),
                  "lanes": sorted({t for t, _ in a.peer_transports("b")})}))
a.close(); b.close()
"""


@pytest.mark.parametrize("transports", ["sm", "tcp"])
def test_without_tcp_no_ucx_port_exists_to_reach(transports):
    """docs/security.md's defence on one host: UCX's tcp interface applies puts from any
    connection (below anything kvmove checks), and with ``transports="sm"`` the process has no
    such interface at all (no listening socket), while shared memory still carries writes and
    notifications between its agents. With tcp, the listener is there: the check can fail."""
    out = subprocess.run([sys.executable, "-c", _LISTENERS, transports,
                          str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=60, cwd=WORKDIR)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if transports == "sm":
        assert report["listening"] == [], report
        assert "tcp" not in report["lanes"], report
    else:
        assert report["listening"], report
