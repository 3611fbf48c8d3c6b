"""The router↔worker control channel's sockets: where it listens, who can reach it, and how
big a message may be.

Who can reach it (issue 15 #6: a DEALER that claimed ``worker-0`` on the tcp loopback port
injected tokens into a client's stream, and one 2-frame message ended the router's receive
loop for good):

* The router binds an ``ipc://`` socket in a fresh private directory (``mkdtemp``: mode 0700,
  removed when the router stops). Every worker is the router's child on this host, so no
  network socket is needed; other users cannot open the directory, so they cannot connect.
  tcp loopback was open to every local user (and to whatever they run).
* Processes of the same user can connect (they could also ptrace the router). What they send
  is dropped: each worker process gets a random identity when it is started, in its
  environment (``IDENTITY_VARIABLE``; a command line is readable by every user), and the
  router takes events only from the identity of a live worker process. ZeroMQ refuses a
  second connection that claims an identity already connected.
* Under Ray (``kvmove-serve --ray``, ``ray_workers.py``) the workers are no children of the
  router and may run on other hosts: the socket is ``tcp://`` on the router's address (a free
  port), which anyone who reaches that address can connect to. The random identity, handed to
  each worker through its actor's arguments (readable by whoever can use the Ray cluster, who
  can run code on its nodes anyway), stays the guard: an unknown identity's messages are
  dropped.
* Every message is parsed in full (``messages.py``) and at most ``MAX_MESSAGE_BYTES``
  (``zmq.MAXMSGSIZE`` on both ends: ZeroMQ disconnects a peer that sends a larger one before
  a byte of it is buffered for us).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from typing import Generic, TypeVar

import zmq

from kvmove.errors import ConfigError

__all__ = ["IDENTITY_VARIABLE", "MAX_MESSAGE_BYTES", "ControlEndpoint", "new_identity",
           "worker_socket"]

# The largest messages are an ``add`` (the prompt's ids, at most 8 bytes each as JSON) and an
# ``ended`` (the output text, at most 12 bytes a character as escaped JSON); a context of
# 1M tokens stays under 32 MiB either way.
MAX_MESSAGE_BYTES = 32 * 2**20
IDENTITY_VARIABLE = "KVMOVE_SERVE_IDENTITY"
_UNIX_PATH_BYTES = 107  # sun_path holds 108 bytes with the terminating NUL


def new_identity(name: str) -> bytes:
    """A worker process's identity: its name (for the logs) and 64 random bits."""
    return f"{name}/{secrets.token_hex(8)}".encode()


# A socket of either ZeroMQ API: the router's endpoint is asyncio's, the workers' and the
# tests' are blocking.
_Socket = TypeVar("_Socket", bound=zmq.Socket)


def _bounded(socket: _Socket) -> _Socket:
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return socket


class ControlEndpoint(Generic[_Socket]):
    """The router's ROUTER socket on ``ipc://<private directory>/control``, or on
    ``tcp://HOST:<free port>`` when workers elsewhere must reach it.

    Args:
        context: the ZeroMQ context to make the socket in (``zmq.asyncio`` for the router).
        host: None for the private ipc socket; else the address to listen on over tcp.

    Raises:
        ConfigError: the socket's path is too long for a Unix socket (a long ``TMPDIR``).
    """

    def __init__(self, context: zmq.Context[_Socket], host: str | None = None) -> None:
        self.directory: str | None = None
        self.socket = _bounded(context.socket(zmq.ROUTER))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown identity raises
        if host is not None:
            self.socket.setsockopt(zmq.IPV6, ":" in host)
            bracketed = f"[{host}]" if ":" in host else host
            port = self.socket.bind_to_random_port(f"tcp://{bracketed}")
            self.address = f"tcp://{bracketed}:{port}"
            return
        self.directory = tempfile.mkdtemp(prefix="kvmove-serve-")  # mode 0700
        path = os.path.join(self.directory, "control")
        if len(os.fsencode(path)) > _UNIX_PATH_BYTES:
            self.close()
            raise ConfigError(f"the control socket's path {path!r} is "
                              f"{len(os.fsencode(path))} bytes, over the {_UNIX_PATH_BYTES} a "
                              "Unix socket allows: set TMPDIR to a shorter directory")
        self.address = f"ipc://{path}"
        self.socket.bind(self.address)

    def close(self) -> None:
        """Closes the socket and removes the directory. Idempotent."""
        self.socket.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def worker_socket(context: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    """A worker's DEALER socket, connected to the router at ``address`` as ``identity``."""
    socket = _bounded(context.socket(zmq.DEALER))
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 500)
    socket.connect(address)
    return socket
