"""One upstream call of the vLLM proxy (``proxy.py``): sent to an instance, counted in
flight and timed in ``ProxyMetrics``, its failures turned into the client's 502 or 504 naming
the instance, its answer read whole or relayed chunk by chunk.

Whatever way a call ends (answered, failed, its client gone, its task cancelled) it is ended
exactly once: the in-flight count the pools pick by must not drift, and an upstream stream
left open would keep vLLM generating for nobody.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi.responses import StreamingResponse

from kvmove.serve.api import APIError, error_body
from kvmove.serve.vllm.pools import Instance, ProxyMetrics

__all__ = ["Call", "Relay", "UpstreamError"]

log = logging.getLogger(__name__)


class UpstreamError(APIError):
    """An upstream call that failed: 502 (unreachable, broken answer) or 504 (timed out)."""


def _kind(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    return "connect" if isinstance(error, httpx.ConnectError) else "protocol"


class Call:
    """One request to one instance, counted in flight and timed from send to last byte."""

    def __init__(self, client: httpx.AsyncClient, metrics: ProxyMetrics, timeout: float,
                 instance: Instance) -> None:
        self.client, self.metrics, self.timeout = client, metrics, timeout
        self.instance = instance
        self.labels = (instance.pool, instance.url)
        self.start = time.monotonic()
        self.waiting_first = True
        self.ended = False
        self.finished = False  # the whole answer arrived
        instance.in_flight += 1
        metrics.requests.labels(*self.labels).inc()
        metrics.in_flight.labels(*self.labels).inc()

    def count(self, kind: str) -> None:
        self.metrics.errors.labels(*self.labels, kind).inc()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.instance.in_flight -= 1
        self.metrics.in_flight.labels(*self.labels).dec()
        self.metrics.latency.labels(*self.labels).observe(time.monotonic() - self.start)

    def error(self, error: httpx.HTTPError) -> UpstreamError:
        """Counts ``error`` and ends the call; the client's 502 or 504."""
        self.count(_kind(error))
        self.end()
        return self.describe(error)

    def describe(self, error: httpx.HTTPError) -> UpstreamError:
        kind = _kind(error)
        where = f"{self.instance.pool} instance {self.instance.url}"
        if kind == "timeout":
            return UpstreamError(504, f"{where} did not answer within {self.timeout:g} s "
                                      f"(--request-timeout)", kind="upstream_timeout")
        what = "is unreachable" if kind == "connect" else "broke off its answer"
        detail = str(error) or type(error).__name__
        return UpstreamError(502, f"{where} {what}: {detail}", kind="upstream_error")

    async def open(self, method: str, path: str, body: dict | None = None,
                   headers: dict[str, str] | None = None,
                   sent: asyncio.Event | None = None) -> httpx.Response:
        """Sends the request; returns once the answer's headers arrived. ``sent`` is set once
        the request's body is on the wire (or sending failed)."""
        extensions: dict[str, Any] = {}
        if sent is not None:
            async def trace(name: str, info: dict) -> None:
                if name.endswith(("send_request_body.complete", ".failed")):
                    sent.set()
            extensions["trace"] = trace
        client = self.client
        request = client.build_request(method, self.instance.url + path, json=body,
                                       headers=headers, extensions=extensions)
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise self.error(error) from None
        except BaseException:
            self.end()
            raise
        finally:
            if sent is not None:
                sent.set()
        if not response.is_success:
            self.count("status")
        return response

    async def read(self, response: httpx.Response) -> bytes:
        """The whole answer; the call ends here."""
        chunks = []
        try:
            async for chunk in response.aiter_bytes():
                self._first_byte()
                chunks.append(chunk)
        except httpx.HTTPError as error:
            raise self.error(error) from None
        finally:
            await self.close(response)
        self.finished = True
        return b"".join(chunks)

    async def relay(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The answer chunk by chunk, as it comes; a stream broken upstream ends with an
        ``error`` event (the status line has long been sent), which OpenAI's client raises."""
        try:
            async for chunk in response.aiter_bytes():
                self._first_byte()
                yield chunk
            self.finished = True
        except httpx.HTTPError as error:
            upstream = self.describe(error)
            self.count("stream")
            log.warning("%s", upstream)
            yield f"data: {json.dumps(error_body(str(upstream), upstream.kind))}\n\n".encode()
        finally:
            await self.close(response)

    async def close(self, response: httpx.Response) -> None:
        """Closes the upstream answer (a stream cut short closes its connection, so vLLM
        aborts the request) and ends the call, even while being cancelled."""
        with anyio.CancelScope(shield=True):
            await response.aclose()
        self.end()

    def _first_byte(self) -> None:
        if self.waiting_first:
            self.waiting_first = False
            elapsed = time.monotonic() - self.start
            self.metrics.ttfb.labels(*self.labels).observe(elapsed)


class Relay(StreamingResponse):
    """A decode instance's stream passed through. However it ends (finished, client gone,
    never started because the client left first) the upstream stream is closed, and a push's
    prefill, no longer of use when the decode did not finish, is cancelled."""

    def __init__(self, call: Call, upstream: httpx.Response, rid: str,
                 prefill: asyncio.Task | None) -> None:
        super().__init__(call.relay(upstream), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type", "text/event-stream"),
                         headers={"X-Request-Id": rid})
        self.call, self.upstream, self.prefill = call, upstream, prefill

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.call.close(self.upstream)
            if self.prefill is not None and not self.call.finished:
                self.prefill.cancel()
