"""Which HTTP requests get in, decided before the API sees them: the Host header, the body's
size and arrival, and the number of completions in flight. Each refusal is OpenAI's error
body.

* **Host** (421): only the names in ``ServeConfig.hosts()`` (by default the loopback names and
  the address the server is bound to). A web page can make a browser send requests to
  127.0.0.1 by pointing its own name there (DNS rebinding); those carry the page's name in
  ``Host`` and are refused. A request without a Host header is refused with 400.
* **Body** (413): at most ``max_body_bytes``; a ``Content-Length`` over it is refused before a
  byte is kept, a body without one (chunked) once it passes the limit. What is still coming
  is read and dropped (at most ``DRAIN_BYTES`` within ``DRAIN_SECONDS``) before the answer,
  so that the client reads the 413 rather than a reset connection.
* **Arrival** (408): a completion's body is read whole here, within ``body_timeout`` seconds
  of its headers, before it counts as pending. A request used to count from its headers on,
  with no deadline on its body: ``--max-pending`` connections that never finished their
  bodies turned every completion away with 429 (issue 28). The 408 closes the connection.
* **Pending** (429 with ``Retry-After``): at most ``max_pending`` completions admitted and not
  finished (streams included, until their last byte); ``/health``, ``/metrics`` and
  ``/v1/models`` are never refused for it, so an overloaded server can still be watched.

A pure ASGI middleware rather than a FastAPI dependency: the size check and the body's
deadline have to sit between the socket and FastAPI's body parsing, and the count has to last
until a stream's end. (Headers that never finish never reach ASGI: ``connections.py`` bounds
those.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from starlette.exceptions import HTTPException

from kvmove.serve.api import APIError, error_response

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

__all__ = ["Admission", "AdmissionMetrics", "COMPLETION_PATHS", "RETRY_AFTER_SECONDS"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_SECONDS = 1  # completions of the demo's models take about that long


class AdmissionMetrics(Protocol):
    """What Admission records in: kvmove-serve's ``ServerMetrics`` and the vLLM proxy's
    ``ProxyMetrics`` each have both families."""

    @property
    def pending(self) -> Gauge: ...

    @property
    def rejected(self) -> Counter: ...


class Admission:
    """The middleware (``app.add_middleware(Admission, hosts=..., ...)``).

    Args:
        app: the ASGI app it guards.
        hosts: Host names served (lower case, no port); None: any.
        max_body_bytes: the largest request body.
        body_timeout: seconds a completion's body may take to arrive, from its headers.
        max_pending: completions admitted at once.
        metrics: where refusals and the pending count are recorded.
    """

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str] | None, max_body_bytes: int,
                 body_timeout: float, max_pending: int, metrics: AdmissionMetrics) -> None:
        self.app, self.hosts, self.metrics = app, hosts, metrics
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.max_pending = max_pending
        self.pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._host_refusal(scope) or self._length_refusal(scope)
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send)
            return
        if scope["path"] not in COMPLETION_PATHS:
            await self.app(scope, self._bounded(receive), send)
            return
        try:
            body = await self._body(receive)
        except APIError as error:
            await self._refuse(error, scope, receive, send)
            return
        if body is None:
            return  # the client went away before its body was complete: no one to answer
        if self.pending >= self.max_pending:
            await self._refuse(APIError(
                429, f"{self.pending} requests are in progress, the limit (--max-pending) is "
                     f"{self.max_pending}: retry later", kind="requests",
                code="rate_limit_exceeded"), scope, receive, send)
            return
        self._count(+1)
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self._count(-1)

    async def _body(self, receive: Receive) -> bytes | None:
        """A completion's whole body, read within ``body_timeout`` seconds; None when the
        client disconnected first.

        Raises:
            APIError: 413 past ``max_body_bytes`` (a chunked body announces no length), 408
                past the deadline.
        """
        chunks: list[bytes] = []
        nbytes = 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunks.append(message.get("body", b""))
                    nbytes += len(chunks[-1])
                    if nbytes > self.max_body_bytes:
                        raise _too_large(nbytes, self.max_body_bytes, "at least")
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} "
                                f"s of its headers (--body-timeout); {nbytes} bytes came",
                           code="request_timeout") from None

    def _count(self, step: int) -> None:
        self.pending += step
        self.metrics.pending.set(self.pending)

    async def _refuse(self, error: APIError, scope: Scope, receive: Receive,
                      send: Send) -> None:
        self.metrics.rejected.labels(status=str(error.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 429 else None
        if error.status in (408, 413):  # the rest of the body is not read: no next request
            headers = {"Connection": "close"}
        if error.status == 413 and _header(scope, b"expect") is None:
            await _drain(receive)
        await error_response(error, headers)(scope, receive, send)

    def _host_refusal(self, scope: Scope) -> APIError | None:
        if self.hosts is None:
            return None
        value = _header(scope, b"host")
        if value is None:
            return APIError(400, "the request has no Host header")
        if _host_name(value) not in self.hosts:
            return APIError(421, f"Host {value!r} is not served here (allowed: "
                                 f"{', '.join(sorted(self.hosts))}; --allowed-hosts adds "
                                 "names)", param="Host")
        return None

    def _length_refusal(self, scope: Scope) -> APIError | None:
        value = _header(scope, b"content-length")
        if value is None:
            return None
        if not value.isdigit():
            return APIError(400, f"Content-Length {value!r} is not a number of bytes")
        if int(value) > self.max_body_bytes:
            return _too_large(int(value), self.max_body_bytes)
        return None

    def _bounded(self, receive: Receive) -> Receive:
        """``receive``, raising 413 (through the app's error handler) once the body passes
        the limit: a chunked body announces no length."""
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                self.metrics.rejected.labels(status="413").inc()
                raise HTTPException(413, str(_too_large(seen, self.max_body_bytes, "at least")))
            return message

        return bounded


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive``, handing out ``body`` (read already) first: the app reads it as it came."""
    unread = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return unread.pop() if unread else await receive()

    return replay


def _too_large(nbytes: int, limit: int, qualifier: str = "") -> APIError:
    of = f"{qualifier} {nbytes}".strip()
    return APIError(413, f"the request body of {of} bytes is over the limit (--max-body-bytes) "
                         f"of {limit} bytes")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _host_name(value: str) -> str:
    """``Host``'s name without its port, lower case (``[::1]:8000`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


# What a 413 reads and drops of the body still coming before it answers. A client that sends
# its whole body before it reads (httpx, requests) would otherwise find the connection reset
# under the answer: closing a socket with unread data makes the kernel send a RST, which can
# destroy the 413 in flight (seen under load in CI). Bounded, so an endless body costs at most
# this much; a client that asked "Expect: 100-continue" sent no body and is answered at once.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 2.0


async def _drain(receive: Receive) -> None:
    """Reads and drops what is left of a refused body: until its end, a disconnect, or
    ``DRAIN_BYTES`` / ``DRAIN_SECONDS``, whichever first."""
    nbytes = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while nbytes <= DRAIN_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                nbytes += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return
