"""Metadata exchange between agents over a side channel (ZeroMQ REQ/REP).

The data plane never passes through here: two agents swap their opaque metadata bytes once,
then move blocks with UCX directly. We use ZeroMQ (as vLLM and SGLang do for their control
planes) rather than a hand-rolled socket protocol: framing, reconnects and timeouts are its
job.

Protocol: the connecting side sends its signed metadata (``kvmove.auth``); the listener adds
it as a peer (which checks the signature before anything reads it) and answers
``b"OK" + own signed metadata``, or ``b"ER" + message`` when it was rejected. Messages over
``MAX_MESSAGE_BYTES`` are dropped by ZeroMQ itself, and a listener answers at most
``MAX_EXCHANGES_PER_SECOND`` exchanges a second (the rest are told to come back), so that
no one reaching its port can keep it busy.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq

from kvmove.errors import ConfigError, KVMoveError, PeerError

__all__ = ["MAX_EXCHANGES_PER_SECOND", "MAX_MESSAGE_BYTES", "MetadataServer", "exchange",
           "is_loopback", "net_devices_for"]

logger = logging.getLogger(__name__)

_POLL_MS = 100
MAX_MESSAGE_BYTES = 1 << 20  # metadata is a few hundred bytes
MAX_EXCHANGES_PER_SECOND = 100
_SIOCGIFADDR = 0x8915


def is_loopback(host: str) -> bool:
    """True for a loopback address or name ("127.0.0.1", "::1", "localhost")."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host) if ":" not in host
                                    else host).is_loopback
    except (OSError, ValueError):
        return False


def net_devices_for(host: str) -> str:
    """The UCX device list that keeps UCX's network transports on ``host``'s interface: "lo"
    for loopback, the interface holding ``host`` otherwise, "" (every device) for the wildcard
    addresses. Shared memory and CUDA IPC are not network devices: they stay available.

    Raises:
        ConfigError: no interface holds ``host``.
    """
    if host in ("0.0.0.0", "::", ""):
        return ""
    if is_loopback(host):
        return "lo"
    try:
        address = socket.gethostbyname(host)
    except OSError as error:
        raise ConfigError(f"cannot resolve host {host!r}: {error}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    raise ConfigError(f"no network interface holds {host!r} ({address}): give the agent an "
                      "address of this host, or net_devices")


class _RateLimit:
    """A token bucket: ``rate`` events a second, bursts up to ``rate``."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.last = rate, rate, time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class MetadataServer:
    """Answers metadata exchanges on ``host:port`` from a background thread.

    Args:
        own_metadata: what to send back to each peer.
        add_peer: called with a peer's metadata; returns its name or raises ``KVMoveError``.
        host: address to bind (loopback by default: exposing it is the caller's decision).
        port: 0 picks a free port.
    """

    def __init__(self, own_metadata: bytes, add_peer: Callable[[bytes], str],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self._own = own_metadata
        self._add_peer = add_peer
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._limit = _RateLimit(MAX_EXCHANGES_PER_SECOND)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                port = self._socket.bind_to_random_port(_endpoint(host, 0).rsplit(":", 1)[0])
            else:
                self._socket.bind(_endpoint(host, port))
        except zmq.ZMQError as e:
            self._close_socket()
            raise PeerError(f"cannot listen on {host}:{port}: {e}") from e
        self.address = (host, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvmove-meta-{port}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            request = self._socket.recv()
            if not self._limit.allow():
                self._socket.send(b"ER busy: too many metadata exchanges, try again")
                continue
            try:
                name = self._add_peer(request)
                logger.info("metadata exchange: added peer %r", name)
                self._socket.send(b"OK" + self._own)
            except KVMoveError as e:
                logger.warning("metadata exchange rejected: %s", e)
                self._socket.send(b"ER" + str(e).encode())
            except Exception as e:  # noqa: BLE001 - a REP socket unanswered serves no one again
                logger.exception("metadata exchange failed")
                self._socket.send(b"ER internal error: " + repr(e).encode())

    def close(self) -> None:
        """Stops serving and releases the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5 * _POLL_MS / 1000)
        self._close_socket()

    def _close_socket(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def exchange(own_metadata: bytes, host: str, port: int, timeout: float) -> bytes:
    """Sends ``own_metadata`` to the server at ``host:port`` and returns the server's.

    Raises:
        PeerError: no answer within ``timeout`` seconds, or the server rejected us.
    """
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(_endpoint(host, port))
        sock.send(own_metadata)
        if not sock.poll(int(timeout * 1000)):
            raise PeerError(f"no metadata answer from {host}:{port} within {timeout} s")
        reply = sock.recv()
    finally:
        sock.close(linger=0)
        context.term()
    if reply[:2] != b"OK":
        why = reply[2:].decode(errors="replace")
        raise PeerError(f"{host}:{port} rejected our metadata: {why}")
    return reply[2:]
