"""``kvmove-bench transfer`` between two machines, as ``ucx_perftest`` runs: one side
``--listen [HOST:]PORT`` hosts the far side of the bench, the other ``--connect HOST:PORT``
drives it with the same workload, verification and report as a run on one host.

The two talk over a ``multiprocessing.connection`` socket (the standard library's) opened with
the deployment key as its ``authkey``: each side proves it holds the key (an HMAC challenge
both ways) before anything is read, so a process without the key sends no command, and
nothing it sends is unpickled. The commands are the local peer process's (``peer.FarSide``),
every reply waited for with a deadline (``harness.Channel``); the far side also runs
``ucx_perftest``'s server for the same-link baseline. The listening side serves one run, then
exits, as ``ucx_perftest``'s server does.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import sys
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, TextIO

from kvmove.auth import DeploymentKey, resolve_key
from kvmove.bench import perftest
from kvmove.bench.address import parse_address
from kvmove.bench.harness import Channel, serve
from kvmove.bench.peer import FarSide
from kvmove.bench.report import BenchError
from kvmove.errors import ConfigError

__all__ = ["HANDSHAKE_SECONDS", "RemoteFarSide", "RemotePeer", "RemotePerftest", "listen"]

# How long the far side waits for the next command before it takes its driver for gone.
_IDLE_SECONDS = 600.0
# How long a connection has to prove it holds the key (a silent one must not hold the port).
HANDSHAKE_SECONDS = 5


def _authkey(key: DeploymentKey) -> bytes:
    """The control connection's key, derived from the deployment's (not the key itself)."""
    return hmac.new(key.secret, b"kvmove-bench transfer control\0", hashlib.sha256).digest()


class RemoteFarSide(FarSide):
    """``FarSide`` whose agents serve on ``host`` (the address ``--listen`` was given, or this
    machine's on its default route for ``0.0.0.0``), and that runs ucx_perftest's server."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self._perftest: perftest.LocalServer | None = None

    def setup(self, *args: Any) -> tuple[str, int]:
        name, layout, num_blocks, agent_kwargs, *rest = args
        return super().setup(name, layout, num_blocks, {**agent_kwargs, "host": self.host},
                             *rest)

    def perftest_start(self, transports: str | None, error_handling: bool) -> int:
        """Starts ``ucx_perftest``'s server here; the port its client connects to."""
        binary = perftest.find_binary()
        if binary is None:
            raise BenchError("ucx_perftest not found on the listening side")
        self.perftest_kill()
        env = perftest.environment(binary, transports, error_handling)
        self._perftest = perftest.LocalServer(binary, env)
        return self._perftest.start()[1]

    def perftest_finish(self, timeout: float) -> tuple[int, str]:
        if self._perftest is None:
            raise BenchError("perftest_finish before perftest_start")
        return self._perftest.finish(timeout)

    def perftest_kill(self) -> None:
        if self._perftest is not None:
            self._perftest.kill()

    def close(self) -> None:
        self.perftest_kill()
        super().close()


class RemotePeer(Channel):
    """The near side's handle of a ``--listen`` side: ``Peer``'s calls over the network.

    Raises:
        BenchError: the listening side cannot be reached, refused our key, or did not answer
            in time.
    """

    def __init__(self, host: str, port: int, timeout: float) -> None:
        key = resolve_key()
        label = f"the listening side at {host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_SECONDS)
        except OSError as error:
            raise BenchError(f"cannot reach {label}: {error.strerror or error}") from None
        try:
            conn = _handshake(sock, _authkey(key), listening=False)
        except AuthenticationError:
            raise BenchError(f"{label} holds another deployment key than ours ({key.source}): "
                             "give both sides the same --key-file") from None
        except (OSError, EOFError) as error:
            raise BenchError(f"{label} did not complete the key handshake within "
                             f"{HANDSHAKE_SECONDS} s: {error}") from None
        super().__init__(conn, label, timeout)
        self.host = host
        self.reply("start")

    def failure(self, text: str, kind: str = "", message: str = "") -> Exception:
        return BenchError(text)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.conn.close()


class RemotePerftest:
    """``perftest.Server`` on the listening side (``RemoteFarSide.perftest_start``)."""

    def __init__(self, peer: RemotePeer, transports: str | None, error_handling: bool) -> None:
        self.peer, self.transports, self.error_handling = peer, transports, error_handling

    def start(self) -> tuple[str, int]:
        port = self.peer.call("perftest_start", self.transports, self.error_handling)
        return self.peer.host, int(port)

    def finish(self, timeout: float) -> tuple[int, str]:
        code, text = self.peer.call("perftest_finish", timeout,
                                    timeout=timeout + self.peer.timeout)
        return int(code), str(text)

    def kill(self) -> None:
        self.peer.call("perftest_kill")


def listen(address: str, timeout: float, out: TextIO = sys.stdout) -> int:
    """Serves the far side of one ``--connect`` run on ``address`` (``[HOST:]PORT``; host
    default 0.0.0.0), then returns 0. A connection that does not prove it holds our key within
    ``HANDSHAKE_SECONDS`` (a wrong key, garbage, or silence) is refused and counted, and the
    next one awaited.

    Raises:
        ConfigError: a bad address, or one this machine cannot listen on.
    """
    host, port = parse_address(address, "--listen", default_host="0.0.0.0")
    key = resolve_key()
    try:
        server = socket.create_server((host, port))
    except OSError as error:
        raise ConfigError(f"--listen {address!r}: cannot listen there: "
                          f"{error.strerror or error}") from None
    with server:
        print(f"kvmove-bench transfer: listening on {host}:{port} for one --connect run "
              f"(deployment key: {key.source})", file=out, flush=True)
        refused = 0
        while (conn := _authenticated(server, _authkey(key))) is None:
            refused += 1
            print(f"kvmove-bench transfer: refused a connection without our key "
                  f"({refused} so far)", file=out, flush=True)
    far = RemoteFarSide(host)
    try:
        conn.send(("ok", None))
        serve(conn, far, _IDLE_SECONDS)
    except (EOFError, OSError):
        pass  # the driver is gone: its run ended, or it died
    finally:
        far.close()
        conn.close()
    print("kvmove-bench transfer: the --connect run ended", file=out, flush=True)
    return 0


def _authenticated(server: socket.socket, authkey: bytes) -> Connection | None:
    """The next connection, once it proved it holds ``authkey`` and checked that we do, within
    ``HANDSHAKE_SECONDS``; None if it did not."""
    sock, _ = server.accept()
    try:
        return _handshake(sock, authkey, listening=True)
    except (AuthenticationError, EOFError, OSError):
        return None


def _handshake(sock: socket.socket, authkey: bytes, listening: bool) -> Connection:
    """``sock`` as a ``Connection`` after the standard library's challenge both ways (as
    ``Listener.accept`` and ``Client`` make it), each read and write of it within
    ``HANDSHAKE_SECONDS``; then without a socket deadline (the commands have their own).

    Raises:
        AuthenticationError: the other side holds another key.
        OSError, EOFError: it went silent or away (the connection is closed).
    """
    limit, none = struct.pack("ll", HANDSHAKE_SECONDS, 0), struct.pack("ll", 0, 0)
    sock.settimeout(None)
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, limit)
    conn = Connection(sock.detach())
    try:
        if listening:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    with socket.socket(fileno=conn.fileno()) as view:
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            view.setsockopt(socket.SOL_SOCKET, option, none)
        view.detach()
    return conn
