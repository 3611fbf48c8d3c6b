"""kvmove-serve's control channel (``kvmove/serve/control.py``, ``messages.py``, the router's
receive loop, ``worker_main``'s command handling): issue 15's findings #6 and #8.

Who can reach it and what it takes: a real server, and a stranger (this test process, the
same user: it can reach the socket) that claims a worker's name, or even its real identity,
or sends frames that are not messages; the router drops them, counts them and serves on,
token for token. The frame checks from a *live* worker's identity (which no stranger can
claim) run on a router in this process; a worker's command checks on a worker process the
test drives as its router. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import Iterator

import pytest
import zmq

from kvmove.engine.request import SamplingParams
from kvmove.errors import ConfigError, KVMoveError, PeerError
from kvmove.serve.config import ServeConfig
from kvmove.serve.control import IDENTITY_VARIABLE, MAX_MESSAGE_BYTES, ControlEndpoint
from kvmove.serve.messages import Abort, Tokens, encode
from kvmove.serve.router import Handle, Router
from kvmove.serve.workers import WorkerInfo

from helpers.control import WorkerHarness
from helpers.serve import Server, wait_until

MODEL = "tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
DROPPED = "kvmove_control_messages_dropped_total"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = Server("--mode", "colocated", "--workers", "1", "--no-restart")
    yield server
    server.close()


def _dropped(server: Server, reason: str) -> float:
    return server.samples().get((DROPPED, (("reason", reason),)), 0.0)


def _stranger(address: str, identity: bytes) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return context, socket


def _tcp_listeners(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --- #6: who can reach the control plane --------------------------------------------------------

def test_finding_6_the_control_channel_is_a_private_ipc_socket(server: Server) -> None:
    """No network socket: the router listens on TCP for HTTP only, its control channel is an
    ipc socket in a directory only its user can open."""
    address = server.control_address()
    assert address.startswith("ipc://"), address
    directory = os.path.dirname(address[len("ipc://"):])
    mode = os.stat(directory)
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    port = int(server.url.rsplit(":", 1)[1])
    assert _tcp_listeners(server.process.pid) == {port}


def test_finding_6_a_stranger_claiming_a_worker_cannot_inject(server: Server) -> None:
    """Issue 15 #6's attack: a DEALER claiming ``worker-0`` sends tokens and an ``end`` for
    a client's stream. Dropped and counted; the stream gets exactly its own tokens. Claiming
    the worker's real identity (read from its environment) does not work either: ZeroMQ
    refuses a second connection under an identity already connected."""
    client = server.client()
    prompt = "the control plane"
    expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         **GREEDY).choices[0].text
    with open(f"/proc/{server.worker_pids[0]}/environ", "rb") as f:
        real = next(v.split(b"=", 1)[1] for v in f.read().split(b"\0")
                    if v.startswith(IDENTITY_VARIABLE.encode() + b"="))
    strangers = [_stranger(server.control_address(), identity)
                 for identity in (b"worker-0", real)]
    before = _dropped(server, "unknown_peer")
    try:
        chunks = iter(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                stream=True, **GREEDY))
        first = next(chunks)
        rid = first.id.removeprefix("cmpl-")
        for _, socket in strangers:
            socket.send(json.dumps({"ev": "tokens", "items": [[rid, 65]] * 5}).encode())
            socket.send(json.dumps({"ev": "ended", "rid": rid, "reason": "stop",
                                    "text": "INJECTED"}).encode())
        streamed = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
        wait_until(lambda: _dropped(server, "unknown_peer") >= before + 2, 5.0,
                   "the impostor's two messages counted as dropped")
    finally:
        for context, socket in strangers:
            socket.close()
            context.term()
    assert streamed == expected
    assert _dropped(server, "unknown_peer") == before + 2  # the real identity's never came
    assert server.health()["status"] == "ok"


def test_finding_6_frames_that_are_no_message_leave_the_router_serving(server: Server) -> None:
    """Issue 15 #6: one 2-frame message ended the router's receive loop for good, while
    ``/health`` said ok. Now any frames are dropped, and the router serves on."""
    context, socket = _stranger(server.control_address(), b"worker-0")
    before = _dropped(server, "unknown_peer")
    try:
        for frames in ([b"a", b"b"], [b"\xff" * 100], [b""], [b"x", b"y", b"z"]):
            socket.send_multipart(frames)
        wait_until(lambda: _dropped(server, "unknown_peer") == before + 4, 5.0,
                   "four messages dropped")
    finally:
        socket.close()
        context.term()
    assert server.health()["status"] == "ok"
    result = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                                **GREEDY)
    assert result.usage.completion_tokens == 3


# --- #6: every frame from a live worker is checked (a router in this process) -------------------

def _router_with_worker() -> tuple[Router, WorkerInfo, Handle]:
    """A router (not started) that believes ``worker-0`` is live and holds ``req-0``."""
    router = Router(ServeConfig(mode="colocated", workers=1))
    worker = WorkerInfo("worker-0", "colocated", [], identity=b"worker-0/live", alive=True)
    router.pool.add(worker)
    handle = Handle("req-0", [1, 2, 3], SamplingParams())
    router.handles[handle.rid] = handle
    worker.requests.add(handle.rid)
    return router, worker, handle


class _Exiting:
    """A worker process (Popen-like) that takes ``seconds`` to exit once asked."""

    pid, returncode = 1 << 22, None

    def __init__(self, seconds: float) -> None:
        self.ends = time.monotonic() + seconds

    def poll(self) -> int | None:
        if time.monotonic() >= self.ends:
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()

    def terminate(self) -> None:
        self.ends = 0.0

    kill = terminate


class _Recording:
    """A launcher that starts nothing: it records what it was asked to start."""

    local, control_host = True, None

    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, name: str, role: str, command: list[str], env: dict[str, str]) -> _Exiting:
        self.started.append(name)
        return _Exiting(0.0)

    def close(self) -> None:
        pass


def test_no_worker_is_started_while_the_server_stops() -> None:
    """While workers exit, their pools look short of workers: the planner must not start one
    then (it would outlive the server; CI found one left running). ``stop`` ends the planner
    first, and ``add`` is refused from then on."""

    async def scenario() -> list[str]:
        router = Router(ServeConfig(mode="disagg", planner=True, prefill_bounds=(1, 1),
                                    planner_interval=0.01))
        launcher = _Recording()
        router.launcher = router.supervisor.launcher = launcher
        worker = router.pool.add(WorkerInfo("decode-0", "decode", [], launcher,
                                            process=_Exiting(0.5), alive=True))
        worker.identity = b"decode-0/live"
        router.tasks.loop("planner", router.planner.run())
        await router.stop()
        with pytest.raises(KVMoveError, match="stopping"):
            router.supervisor.add("prefill")
        return launcher.started

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == []


MALFORMED = {  # id: frames after the identity
    "no-frame": [],
    "two-frames": [b"{}", b"{}"],
    "not-json": [b"not json"],
    "not-utf8": [b"\xff\xfe"],
    "array": [b"[1, 2]"],
    "unknown-event": [b'{"ev": "nope"}'],
    "no-kind": [b'{"items": []}'],
    "token-not-int": [b'{"ev": "tokens", "items": [["req-0", "65"]]}'],
    "token-bool": [b'{"ev": "tokens", "items": [["req-0", true]]}'],
    "token-negative": [b'{"ev": "tokens", "items": [["req-0", -1]]}'],
    "item-short": [b'{"ev": "tokens", "items": [["req-0"]]}'],
    "extra-field": [b'{"ev": "tokens", "items": [], "admin": true}'],
    "unknown-reason": [b'{"ev": "ended", "rid": "req-0", "reason": "gone"}'],
    "stats-string": [b'{"ev": "stats", "free_blocks": "all"}'],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_finding_6_a_malformed_message_from_a_live_worker_is_dropped(
        frames: list[bytes]) -> None:
    router, worker, handle = _router_with_worker()
    try:
        router.channel.dispatch([worker.identity, *frames])
        samples = {s.labels["reason"]: s.value for m in router.metrics.control_dropped.collect()
                   for s in m.samples if s.name.endswith("_total")}
        assert samples == {"malformed": 1.0}
        assert handle.events.empty() and not handle.done
        router.channel.dispatch([worker.identity, encode(Tokens(items=[("req-0", 65)]))])
        assert handle.events.get_nowait() == ("token", 65)  # and the next good one is taken
    finally:
        router.control.close()
        router.context.term()


def test_a_command_to_a_worker_that_is_gone_fails_naming_the_worker() -> None:
    """Its request then ends with this error (a client saw ZeroMQ's bare "ZMQError: Host
    unreachable" in the soak)."""

    async def scenario() -> None:
        router, worker, _ = _router_with_worker()  # live to the router; nobody is connected
        try:
            with pytest.raises(PeerError, match="worker worker-0 is unreachable"):
                router.channel.send(worker, Abort(rid="req-0"))
        finally:
            worker.alive = False
            await router.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_finding_6_health_says_down_when_the_receive_loop_ends() -> None:
    """Should the receive loop end anyway (here: its socket closed under it), ``/health``
    stops saying ok: a router that hears no worker serves nobody."""

    async def scenario() -> dict:
        router, worker, _ = _router_with_worker()
        try:
            router.socket.close()
            router.tasks.loop("receive", router.channel.receive())
            await asyncio.sleep(0.1)
            return router.health()
        finally:
            worker.alive = False
            await router.stop()

    report = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert report["status"] == "down"
    assert "receive loop" in report["error"] and "ZMQError" in report["error"]


# --- #6 and #8: a worker's side ---------------------------------------------------------------

@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerHarness]:
    harness = WorkerHarness("prefill", "prefill-0")
    yield harness
    assert harness.close() == 0


BAD_COMMANDS = {  # id: (frames, words the error must hold)
    "two-frames": ([b"{}", b"{}"], "one frame, got 2"),
    "not-json": ([b"{not json"], "Invalid JSON"),
    "unknown-op": ([b'{"op": "format-disk"}'], "format-disk"),
    "abort-without-rid": ([b'{"op": "abort"}'], "abort.rid"),
    "add-bad-prompt": ([b'{"op": "add", "rid": "r", "prompt": ["a"], "params": {}}'],
                       "add.prompt.0"),
    "add-bad-params": ([b'{"op": "add", "rid": "r", "prompt": [1], '
                        b'"params": {"max_tokens": 0}}'], "max_tokens must be"),
    "connect-bad-port": ([b'{"op": "connect", "host": "h", "port": 0}'], "connect.port"),
}


@pytest.mark.parametrize(("frames", "words"), BAD_COMMANDS.values(), ids=BAD_COMMANDS.keys())
def test_finding_6_a_worker_answers_a_bad_command_with_an_error_event(
        worker: WorkerHarness, frames: list[bytes], words: str) -> None:
    worker.send(*frames)
    event = worker.event("error")
    assert words in event["error"], event
    assert worker.process.poll() is None
    worker.send(b'{"op": "abort", "rid": "nothing"}')  # it still takes commands
    assert worker.event("stats")["ev"] == "stats"


def test_finding_6_a_valid_command_that_fails_ends_its_request(worker: WorkerHarness) -> None:
    """A prefill worker's ``add`` without a destination for its KV: that request ends
    (``ended``, abort, with the reason); the worker goes on."""
    worker.send(b'{"op": "add", "rid": "r-1", "prompt": [256, 104, 105], "params": {}}')
    event = worker.event("ended")
    assert (event["rid"], event["reason"]) == ("r-1", "abort")
    assert "decode_peer" in event["error"]
    assert worker.process.poll() is None


def test_finding_8_a_worker_drains_its_agents_notifications(worker: WorkerHarness) -> None:
    """Issue 15 #8: kvmove-serve never read ``Agent.notifications()``, so a peer's
    notifications piled up in the worker. A peer (this test's agent) sends three; the worker
    drains them, drops them and counts them in its stats."""
    import kvmove
    from kvmove.engine.model import MODEL_PRESETS

    host, port = worker.ready["agent"]
    layout = MODEL_PRESETS["tiny"].kv_spec(16)
    with kvmove.Agent("peer", kvmove.KVCache(layout, 4)) as agent:
        name = agent.connect(host, port)
        for i in range(3):
            agent.write(name, [0], [60 + i], notify=b"unread").wait(10.0)
        wait_until(lambda: worker.event("stats")["notifications_dropped"] == 3, 10.0,
                   "the worker's stats count three notifications dropped")


# --- #8: message size ------------------------------------------------------------------------

def test_finding_8_both_ends_bound_a_message() -> None:
    """``zmq.MAXMSGSIZE`` on the router's and the workers' sockets: a peer that sends more
    is disconnected by ZeroMQ before anything reaches the router; the router hears the next
    peer as usual."""
    from kvmove.serve.control import worker_socket

    context = zmq.Context()
    endpoint = ControlEndpoint(context)
    sockets = [worker_socket(context, endpoint.address, f"w{i}".encode()) for i in range(2)]
    try:
        assert endpoint.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
        assert sockets[0].getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
        sockets[0].send(b"x" * (MAX_MESSAGE_BYTES + 1))
        sockets[1].send(b"small")
        deadline = time.monotonic() + 10.0
        received = []
        while time.monotonic() < deadline and endpoint.socket.poll(500):
            received.append(endpoint.socket.recv_multipart())
        assert received == [[b"w1", b"small"]]
    finally:
        for socket in sockets:
            socket.close(linger=0)
        endpoint.close()
        context.term()
    assert not os.path.exists(endpoint.directory)


def test_finding_6_the_control_directory_is_removed_on_exit(server: Server) -> None:
    """Last: it stops the module's server."""
    directory = os.path.dirname(server.control_address()[len("ipc://"):])
    assert os.path.isdir(directory)
    server.close()
    assert not os.path.exists(directory)


# --- the deployment key (issue 15 #1, the server's part) --------------------------------------

def test_finding_1_workers_share_the_key_file_they_are_given(tmp_path) -> None:
    """``--key-file``: every worker is told the file (its command line names it, never the
    key), and the disaggregated workers' agents peer under it: a KV hand-off completes."""
    key = tmp_path / "deployment.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    server = Server("--mode", "disagg", "--no-restart", "--key-file", str(key))
    try:
        reply = server.client().completions.create(model=MODEL, prompt="a key", max_tokens=4,
                                                    **GREEDY)
        assert len(reply.choices[0].text) > 0 and reply.usage.completion_tokens == 4
        assert len(server.worker_pids) == 2
        for pid in server.worker_pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            assert args[args.index(b"--key-file") + 1] == str(key).encode()
            assert key.read_text().strip().encode() not in b" ".join(args)
    finally:
        server.close()


@pytest.mark.parametrize("content, message", [(b"short", "at least 16 bytes"),
                                              (None, "cannot read --key-file")])
def test_finding_1_a_bad_key_file_is_refused_before_anything_starts(tmp_path, content,
                                                                     message) -> None:
    path = tmp_path / "k"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        ServeConfig(key_file=str(path))


def test_finding_1_agents_beyond_loopback_need_a_deployment_key(monkeypatch, tmp_path) -> None:
    for name in ("KVMOVE_KEY", "KVMOVE_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="not loopback") as excinfo:
        ServeConfig(agent_host="10.1.2.3")
    assert "--key-file" in str(excinfo.value)
    key = tmp_path / "k"
    key.write_bytes(os.urandom(32))
    assert ServeConfig(agent_host="10.1.2.3", key_file=str(key)).key_file == str(key)
