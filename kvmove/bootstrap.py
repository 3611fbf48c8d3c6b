"""Metadata exchange between agents over a side channel (ZeroMQ REQ/REP).

The data plane never passes through here: two agents swap their opaque metadata bytes once,
then move blocks with UCX directly. We use ZeroMQ (as vLLM and SGLang do for their control
planes) rather than a hand-rolled socket protocol: framing, reconnects and timeouts are its
job.

Protocol: the connecting side sends its metadata; the listener adds it as a peer and answers
``b"OK" + own metadata``, or ``b"ER" + message`` when the metadata was rejected.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvmove.errors import KVMoveError, PeerError

__all__ = ["MetadataServer", "exchange"]

logger = logging.getLogger(__name__)

_POLL_MS = 100


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
            try:
                name = self._add_peer(request)
                logger.info("metadata exchange: added peer %r", name)
                self._socket.send(b"OK" + self._own)
            except KVMoveError as e:
                logger.warning("metadata exchange rejected: %s", e)
                self._socket.send(b"ER" + str(e).encode())

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
        raise PeerError(f"{host}:{port} rejected our metadata: {reply[2:].decode(errors='replace')}")
    return reply[2:]
