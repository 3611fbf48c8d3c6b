"""Metadata exchange between agents over a side channel (ZeroMQ REQ to ROUTER).

The data plane never passes through here: two agents swap their opaque metadata bytes once,
then move blocks with UCX directly. We use ZeroMQ (as vLLM and SGLang do for their control
planes) rather than a hand-rolled socket protocol: framing, reconnects and timeouts are its
job.

Protocol: the connecting side (a REQ socket) sends its signed metadata (``kvmove.auth``);
the listener checks the signature, adds it as a peer and answers ``b"OK" + own signed
metadata``, or ``b"ER" + message`` when it was rejected.

What bounds the listener's work, in the order a message meets it:

1. ZeroMQ drops a message over ``MAX_MESSAGE_BYTES``, and holds at most ``_QUEUED_MESSAGES``
   unread ones per connection (then TCP pushes back on the sender);
2. the signature is checked first (an HMAC: microseconds). Input without the deployment's
   signature costs no exchange token: it is counted, and answered at most
   ``MAX_REFUSALS_PER_SECOND`` times a second per source (the rest go unanswered), so a
   peer with the wrong key still hears why, and a flood hears almost nothing;
3. signed exchanges are answered at most ``MAX_EXCHANGES_PER_SECOND`` a second per source
   (the rest are told to come back).

A source is the sender's IP address (ZeroMQ's ``Peer-Address`` of the message), else its
connection (ROUTER's routing id). Per source rather than one shared budget: the shared one
was spent by whoever sent most, and a keyless flood (975k messages in 12 s) refused every
keyed connect. A REP socket tells neither, hence the ROUTER.
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
from dataclasses import dataclass, fields

import zmq

from kvmove.errors import ConfigError, KVMoveError, PeerError
from kvmove.rate_limit import PerSource

__all__ = ["ListenerStats", "MAX_EXCHANGES_PER_SECOND", "MAX_MESSAGE_BYTES",
           "MAX_REFUSALS_PER_SECOND", "MetadataServer", "WILDCARDS", "advertised_host",
           "exchange", "is_loopback", "net_devices_for"]

logger = logging.getLogger(__name__)

_POLL_MS = 100
MAX_MESSAGE_BYTES = 1 << 20  # metadata is a few hundred bytes
MAX_EXCHANGES_PER_SECOND = 100  # signed exchanges, per source
MAX_REFUSALS_PER_SECOND = 10  # answers to unsigned input, per source
_QUEUED_MESSAGES = 64  # unread per connection; a connect sends one
_SUMMARY_SECONDS = 10.0  # at most one log line of dropped input per this many seconds
_SIOCGIFADDR = 0x8915


def is_loopback(host: str) -> bool:
    """True for a loopback address or name ("127.0.0.1", "::1", "localhost")."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host) if ":" not in host
                                    else host).is_loopback
    except (OSError, ValueError):
        return False


WILDCARDS = ("0.0.0.0", "::", "")


def advertised_host(host: str) -> str:
    """What peers are told to connect to for a listener bound to ``host``: ``host`` itself,
    or for a wildcard the address this host sends from on its default route (an agent that
    advertised "0.0.0.0" had its peers connect to themselves).

    Raises:
        ConfigError: a wildcard, and no route to tell an address by: name one.
    """
    if host not in WILDCARDS:
        return host
    family, probe = ((socket.AF_INET6, "2001:db8::1") if host == "::" else
                     (socket.AF_INET, "192.0.2.1"))  # documentation ranges: nothing is sent
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        try:
            udp.connect((probe, 9))
            return str(udp.getsockname()[0])
        except OSError as error:
            raise ConfigError(f"listening on {host!r}, this host has no route to tell peers an "
                              f"address by ({error}): give the address to advertise") from None


def net_devices_for(host: str) -> str:
    """The UCX device list that keeps UCX's network transports on ``host``'s interface: "lo"
    for loopback, the interface holding ``host`` otherwise, "" (every device) for the wildcard
    addresses. Shared memory and CUDA IPC are not network devices: they stay available.

    Raises:
        ConfigError: no interface holds ``host``.
    """
    if host in WILDCARDS:
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


@dataclass(frozen=True, slots=True)
class ListenerStats:
    """What a metadata listener received (``Agent.listener_stats()``).

    Attributes:
        joined: exchanges answered with our metadata.
        refused: signed, but adding the peer failed (answered with why).
        busy: signed, over its source's ``MAX_EXCHANGES_PER_SECOND`` (told to come back).
        unsigned: not signed with the deployment's key, or not a REQ's message at all.
        dropped: of the unsigned, those left unanswered (over the source's
            ``MAX_REFUSALS_PER_SECOND``, or no REQ to answer).
    """

    joined: int = 0
    refused: int = 0
    busy: int = 0
    unsigned: int = 0
    dropped: int = 0


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class MetadataServer:
    """Answers metadata exchanges on ``host:port`` from a background thread.

    Args:
        own_metadata: what to send back to each peer.
        verify: returns the blob inside signed metadata, or raises ``KVMoveError`` (the
            deployment key's ``verify``); runs before any rate limit is spent.
        add_peer: called with a verified blob; returns the peer's name or raises
            ``KVMoveError``.
        host: address to bind (loopback by default: exposing it is the caller's decision).
        port: 0 picks a free port.
    """

    def __init__(self, own_metadata: bytes, verify: Callable[[bytes], bytes],
                 add_peer: Callable[[bytes], str], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self._own = own_metadata
        self._verify, self._add_peer = verify, add_peer
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, _QUEUED_MESSAGES)
        self._exchanges = PerSource(MAX_EXCHANGES_PER_SECOND)
        self._refusals = PerSource(MAX_REFUSALS_PER_SECOND)
        self._counts = dict.fromkeys((f.name for f in fields(ListenerStats)), 0)
        self._logged = (time.monotonic(), 0)  # the last summary: when, and dropped by then
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

    def stats(self) -> ListenerStats:
        """What this listener received so far."""
        return ListenerStats(**self._counts)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=False)
            if len(frames) == 3 and not frames[1].bytes:  # REQ's: routing id, "", request
                reply = self._answer(frames[2], _source(frames))
            else:
                self._count("unsigned")
                reply = None
            if reply is not None:
                self._socket.send_multipart([frames[0], b"", reply])
            else:
                self._count("dropped")
                self._summarize()

    def _answer(self, request: zmq.Frame, source: str) -> bytes | None:
        """The reply to one request, or None to leave it unanswered."""
        try:
            blob = self._verify(request.bytes)
        except KVMoveError as e:
            self._count("unsigned")
            if not self._refusals.allow(source):
                return None
            logger.warning("metadata exchange from %s refused: %s", source, e)
            return b"ER" + str(e).encode()
        if not self._exchanges.allow(source):
            self._count("busy")
            return b"ER busy: too many metadata exchanges from " + source.encode() + \
                b", try again"
        return self._add(blob)

    def _add(self, blob: bytes) -> bytes:
        try:
            name = self._add_peer(blob)
        except KVMoveError as e:
            self._count("refused")
            logger.warning("metadata exchange rejected: %s", e)
            return b"ER" + str(e).encode()
        except Exception as e:  # noqa: BLE001 - a listener whose thread ends serves no one
            self._count("refused")
            logger.exception("metadata exchange failed")
            return b"ER internal error: " + repr(e).encode()
        self._count("joined")
        logger.info("metadata exchange: added peer %r", name)
        return b"OK" + self._own

    def _count(self, what: str) -> None:
        self._counts[what] += 1

    def _summarize(self) -> None:
        """A warning of the input dropped unanswered, at most every ``_SUMMARY_SECONDS``: a
        flood must not become a flood of log lines."""
        since, then = self._logged
        now, dropped = time.monotonic(), self._counts["dropped"]
        if now - since >= _SUMMARY_SECONDS:
            logger.warning("metadata listener %s:%d: %d unsigned messages dropped unanswered "
                           "in the last %.0f s", *self.address, dropped - then, now - since)
            self._logged = (now, dropped)

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


def _source(frames: list[zmq.Frame]) -> str:
    """Who sent a message: the address ZeroMQ gives for it (tcp: the IP, no port), else its
    connection (ROUTER's routing id, the first frame)."""
    try:
        return str(frames[-1].get("Peer-Address"))
    except zmq.ZMQError:  # inproc: no address
        return "connection " + frames[0].bytes.hex()


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
