"""The HTTP server's connections: a deadline on each request's headers, and a bound on how many
are open, so that half-sent requests cannot hold the server's file descriptors.

Issue 28 (slowloris): ~1,100 connections that sent part of their headers and then nothing
took every file descriptor of a server at the common limit of 1,024, and ``/health`` went
unanswered for as long as they stayed open. Three measures, in the order they act:

1. ``raise_fd_limit`` raises the soft ``RLIMIT_NOFILE`` to the hard one at start (often
   1,024 of 524,288): the cheapest bound is one far away.
2. Past ``max_connections`` (by default that limit less an eighth, at least 64, for the
   router's own descriptors: ``max_connections_for``), a new connection makes room by
   closing the one that has waited longest for a request to arrive (headers or body
   unfinished, or idle between two requests); one being answered is never closed. The
   attacker's connections are the oldest such: a real client sends its request within
   milliseconds of connecting, and is answered.
3. A request's headers must arrive within ``header_timeout`` seconds of the connection (or of
   the previous response): then the connection is closed, with a 408 if part of them came.
   The body's deadline is ``admission.py``'s.

Why our own code: uvicorn (0.55) has no deadline on headers (its ``timeout_keep_alive`` starts
only after a first response), and its ``limit_concurrency`` counts connections still sending
headers, so under this attack every request, ``/health`` included, would get its 503. h11
already bounds a header's size (``h11_max_incomplete_event_size``, 16 KiB: a 400). The
measures are a subclass of uvicorn's h11 protocol (the one uvicorn picks when httptools is not
installed; kvmove-serve now uses it either way), the least code that sees a connection before
its request: an ASGI middleware sees none until its headers are complete.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvmove.serve.config import ConnectionLimits

__all__ = ["guarded_h11", "max_connections_for", "raise_fd_limit"]

logger = logging.getLogger(__name__)

_SUMMARY_SECONDS = 10.0  # at most one log line of closed connections per this many seconds
# the states of a connection whose request has not fully arrived (or that waits for the next)
_ARRIVING = (h11.IDLE, h11.SEND_BODY)
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
              b"connection: close\r\ncontent-length: 42\r\n\r\n"
              b"the request headers did not arrive in time")


def raise_fd_limit() -> int:
    """Raises this process's soft file-descriptor limit to its hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as error:  # a sandbox may refuse
            logger.warning("cannot raise the file-descriptor limit from %d to %d: %s", soft,
                           hard, error)
    return soft


def max_connections_for(fd_limit: int) -> int:
    """The default ``max_connections``: ``fd_limit`` less what the router itself needs (its
    workers' pipes and sockets, logs, the listening socket: 22 with two workers), for which
    we keep an eighth, at least 64: 896 connections of 1,024 descriptors, 192 of 256."""
    return max(1, fd_limit - max(fd_limit // 8, 64))


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header deadline and the connection bound (the module's
    docstring), for ``uvicorn.Config(http=...)``. Raises the file-descriptor limit first."""
    fd_limit = raise_fd_limit()
    most = limits.max_connections or max_connections_for(fd_limit)
    logger.info("HTTP: at most %d connections (file descriptors: %d), headers within %g s, "
                "bodies within %g s", most, fd_limit, limits.header_timeout,
                limits.body_timeout)
    return type("GuardedH11Protocol", (_GuardedH11,),
                {"header_timeout": limits.header_timeout, "max_connections": most,
                 "waiting": {}})


class _Report:
    """Counts connections closed by the guard, logged as one line every few seconds: a flood
    of connections must not become a flood of log lines."""

    counts: ClassVar[dict[str, int]] = {"timed out": 0, "made room": 0}
    logged: ClassVar[float] = 0.0

    @classmethod
    def closed(cls, why: str) -> None:
        cls.counts[why] += 1
        now = time.monotonic()
        if now - cls.logged >= _SUMMARY_SECONDS:
            logger.warning("HTTP connections closed before their request arrived, so far: %s",
                           ", ".join(f"{n} {what}" for what, n in cls.counts.items()))
            cls.logged = now


class _GuardedH11(H11Protocol):
    header_timeout: ClassVar[float]
    max_connections: ClassVar[int]
    # the connections waiting for a request to arrive, longest first (a dict: ordered, O(1)
    # to move one to the end); an entry whose request has arrived since is skipped and dropped
    waiting: ClassVar[dict[_GuardedH11, None]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._stop_timer()  # the headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_request()  # keep-alive: the next one

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.waiting.pop(self, None)
        super().connection_lost(exc)

    def _await_request(self) -> None:
        self.waiting.pop(self, None)
        self.waiting[self] = None
        self._stop_timer()
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _stop_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.conn.trailing_data[0]:  # part of a request came: say why it ends
                self.transport.write(_TIMED_OUT)
            self.transport.close()
            _Report.closed("timed out")

    def _make_room(self) -> None:
        """Closes the connection that has waited longest for its request: headers or body
        unfinished, or idle between two requests (this one, if no other waits)."""
        while self.waiting:
            connection = next(iter(self.waiting))
            del self.waiting[connection]
            if connection.conn.their_state in _ARRIVING and \
                    not connection.transport.is_closing():
                connection.transport.close()
                _Report.closed("made room")
                return
