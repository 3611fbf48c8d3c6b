"""kvmove-serve's HTTP front door (``kvmove/serve/admission.py``, ``api.py``, ``app.py``):
issue 15's finding #9, one test per limit.

A real server with small limits (``--max-pending 1``, ``--max-body-bytes 65536``) and the
official ``openai`` client or ``httpx``: each refusal has its status and OpenAI's error body,
and the server serves the next request. One test runs the app in this process, to see that
tokenizing leaves the event loop free. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest

from kvmove.engine.tokenizer import ByteTokenizer
from kvmove.serve.api import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvmove.serve.config import ServeConfig
from kvmove.serve.router import Router

from helpers.serve import HTTP_SECONDS, Server, wait_until

MODEL = "tiny"
BODY_LIMIT = 65536
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    server = Server("--mode", "colocated", "--workers", "1", "--no-restart", "--max-pending",
                    "1", "--max-body-bytes", str(BODY_LIMIT), "--log-level", "debug")
    yield server
    server.close()


def _refused(response: httpx.Response, status: int, param: str | None = None,
             kind: str = "invalid_request_error") -> str:
    """Asserts OpenAI's error body with ``status``; its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}, error
    assert (error["type"], error["param"]) == (kind, param), error
    return error["message"]


def _serves(server: Server) -> None:
    # ignore_eos: the tiny random model's greedy second token for "hi" is not the point here
    # (one run under load ended at an EOS after 1 token)
    response = server.post(COMPLETIONS, json={**GOOD, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# --- the body --------------------------------------------------------------------------------

def test_finding_9_body_over_the_limit_is_413(server: Server) -> None:
    body = {**GOOD, "prompt": "x" * BODY_LIMIT}
    message = _refused(server.post(COMPLETIONS, json=body), 413)
    assert str(BODY_LIMIT) in message and "--max-body-bytes" in message
    _serves(server)


def test_finding_9_a_chunked_body_over_the_limit_is_413(server: Server) -> None:
    """No Content-Length: refused once the body passes the limit."""
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = server.post(COMPLETIONS, content=chunks(),
                           headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert str(BODY_LIMIT) in _refused(response, 413)
    _serves(server)


def test_finding_9_a_20_mib_prompt_is_refused_without_tokenizing(server: Server) -> None:
    """Issue 15 #9's case: a 20 MiB prompt was tokenized on the event loop before the
    length check. Its body is over the limit: refused on its Content-Length."""
    _refused(server.post(COMPLETIONS, json={**GOOD, "prompt": "x" * (20 << 20)}), 413)
    _serves(server)


def test_finding_9_a_prompt_longer_in_bytes_than_the_context_is_refused_before_tokenizing(
        server: Server) -> None:
    """Within the body limit, but more bytes than 4,096 tokens of the byte tokenizer can
    hold: refused by its length in bytes (the message says so), not its tokens."""
    message = _refused(server.post(COMPLETIONS, json={**GOOD, "prompt": "é" * 5000}), 400,
                       "prompt")
    assert "prompt of 10000 bytes cannot fit the model's context of 4096 tokens" in message
    _serves(server)


def test_finding_9_tokenizing_runs_off_the_event_loop() -> None:
    """The app in this process, with a tokenizer that blocks until released: while one
    request is being tokenized, another request is answered (on the event loop it would
    wait for ever: the deadline fails the test instead)."""
    from kvmove.serve.app import create_app

    release, started = threading.Event(), threading.Event()

    class BlockingTokenizer(ByteTokenizer):
        def encode(self, text: str, add_bos: bool = True) -> list[int]:
            started.set()
            assert release.wait(HTTP_SECONDS), "never released"
            return super().encode(text, add_bos)

    router = Router(ServeConfig(mode="colocated", workers=1))
    app = create_app(router, BlockingTokenizer(), MODEL, 4096, manage_router=False)

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            slow = asyncio.create_task(http.post(COMPLETIONS, json=GOOD))
            await asyncio.to_thread(started.wait, HTTP_SECONDS)
            models = await http.get("/v1/models")  # answered while the other tokenizes
            release.set()
            return models.status_code, (await slow).status_code

    try:
        models, slow = asyncio.run(asyncio.wait_for(scenario(), HTTP_SECONDS))
    finally:
        release.set()
        router.control.close()
        router.context.term()
    assert models == 200
    assert slow == 500  # tokenized, then no worker (this router was never started)


# --- pending requests -------------------------------------------------------------------------

def test_finding_9_more_than_max_pending_is_429_with_retry_after(server: Server) -> None:
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="hold", max_tokens=2000,
                                       stream=True, temperature=0,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # admitted, and streaming: the one pending request
    try:
        response = server.post(COMPLETIONS, json=GOOD)
        message = _refused(response, 429, kind="requests")
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert response.headers["retry-after"] == "1"
        assert "--max-pending" in message and "1" in message
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert server.get("/health").status_code == 200  # watching is never refused
        assert server.get("/metrics").status_code == 200
        assert server.samples()["kvmove_http_pending_requests", ()] == 1
    finally:
        stream.close()
    wait_until(lambda: server.post(COMPLETIONS, json=GOOD).status_code == 200, 10.0,
               "served again once the stream ended")
    assert server.samples()["kvmove_http_rejected_requests_total", (("status", "429"),)] >= 2


# --- the request's fields ---------------------------------------------------------------------

def test_finding_9_stop_strings_are_bounded_in_count_and_length(server: Server) -> None:
    """The finding's 1,000 stop strings of 50 characters, one too many, one too long: each a
    400 naming the limit; the limits themselves are served."""
    cases = [(["s" * 50 + str(i) for i in range(1000)], f"at most {MAX_STOP_STRINGS}"),
             ([str(i) for i in range(MAX_STOP_STRINGS + 1)], f"got {MAX_STOP_STRINGS + 1}"),
             (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters")]
    for stop, words in cases:
        message = _refused(server.post(COMPLETIONS, json={**GOOD, "stop": stop}), 400, "stop")
        assert words in message, message
    widest = [f"{i:02d}" + "z" * (MAX_STOP_CHARS - 2) for i in range(MAX_STOP_STRINGS)]
    response = server.post(COMPLETIONS, json={**GOOD, "stop": widest})
    assert response.status_code == 200, response.text


def test_finding_9_n_other_than_1_is_refused(server: Server) -> None:
    for n in (0, 2, 5):
        assert f"got {n}" in _refused(server.post(COMPLETIONS, json={**GOOD, "n": n}), 400, "n")
    with pytest.raises(openai.BadRequestError) as error:
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)
    assert error.value.param == "n"
    assert server.post(COMPLETIONS, json={**GOOD, "n": 1}).status_code == 200


def test_finding_9_max_tokens_beyond_the_context_is_refused(server: Server) -> None:
    for path, body, param in [
            (COMPLETIONS, {**GOOD, "max_tokens": 4096}, "max_tokens"),
            (COMPLETIONS, {**GOOD, "max_tokens": 10**12}, "max_tokens"),
            (CHAT, {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 10**6},
             "max_completion_tokens")]:
        message = _refused(server.post(path, json=body), 400, param)
        assert "context of 4096 tokens" in message and "at most 4095" in message
    _serves(server)


@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "a", "stop": ["\\udfff"], "max_tokens": 2}',
     "stop"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages.0.content"),
], ids=["prompt", "stop", "chat-content"])
def test_finding_9_a_lone_surrogate_is_400(server: Server, path: str, body: bytes,
                                           param: str) -> None:
    """JSON can carry half of a UTF-16 pair, which no UTF-8 can encode: it was a plain 500."""
    response = server.post(path, content=body, headers={"content-type": "application/json"})
    assert "lone surrogate" in _refused(response, 400, param)
    _serves(server)


def test_finding_9_a_body_that_is_not_utf8_is_400(server: Server) -> None:
    response = server.post(COMPLETIONS, content=b'{"model": "tiny", "prompt": "\xff\xfe"}',
                           headers={"content-type": "application/json"})
    assert _refused(response, 400)  # OpenAI's body, not FastAPI's {"detail"}
    _serves(server)


# --- routes, methods, hosts -------------------------------------------------------------------

def test_finding_9_unknown_routes_and_wrong_methods_get_openai_error_bodies(
        server: Server) -> None:
    assert "GET /nope" in _refused(server.get("/nope"), 404)
    assert "POST /v1/embeddings" in _refused(server.post("/v1/embeddings", json={}), 404)
    response = server.get(COMPLETIONS)
    assert "GET /v1/completions" in _refused(response, 405)
    assert response.headers["allow"] == "POST"
    _refused(httpx.delete(f"{server.url}/v1/models", timeout=HTTP_SECONDS), 405)
    with pytest.raises(openai.NotFoundError) as error:
        server.client().embeddings.create(model=MODEL, input="hi")
    assert "Invalid URL" in str(error.value)
    _serves(server)


def test_finding_9_a_host_not_allowed_is_421(server: Server) -> None:
    """DNS rebinding: a page's own name pointed at 127.0.0.1 arrives as that name in Host."""
    port = urlparse(server.url).port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        response = httpx.get(f"{server.url}/v1/models", headers={"host": host},
                             timeout=HTTP_SECONDS)
        assert host in _refused(response, 421, "Host")
    response = server.post(COMPLETIONS, json=GOOD, headers={"host": "evil.example"})
    _refused(response, 421, "Host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert httpx.get(f"{server.url}/v1/models", headers={"host": host},
                         timeout=HTTP_SECONDS).status_code == 200, host


def test_finding_9_a_request_without_host_is_400(server: Server) -> None:
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=HTTP_SECONDS) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert b"the request has no Host header" in reply


def test_finding_9_allowed_hosts_default_and_option() -> None:
    assert ServeConfig().hosts() == {"localhost", "127.0.0.1", "::1"}
    assert ServeConfig(host="10.0.0.5").hosts() == {"localhost", "127.0.0.1", "::1",
                                                    "10.0.0.5"}
    assert ServeConfig(allowed_hosts=("Example.test", "[::1]")).hosts() == {"example.test",
                                                                            "::1"}
    assert ServeConfig(allowed_hosts=("*",)).hosts() is None


# --- logging (this server runs at --log-level debug) ------------------------------------------

def test_worker_output_is_logged_with_the_workers_name(server: Server) -> None:
    """Workers' stdout and stderr were thrown away; now each line reaches the server's log
    with the worker's name, at the worker's level (debug here: each command), and uvicorn
    logs at the server's level (its access lines are info: they were never shown at its old
    fixed warning)."""
    _serves(server)
    wait_until(lambda: "[worker-0] kvmove.serve.worker_main: command add" in
               server.stderr_text(None), 5.0, "worker-0's debug line in the server's log")
    log = server.stderr_text(None)
    assert "[worker-0] kvmove.serve.worker_main: ready" in log
    assert 'uvicorn.access' in log and '"POST /v1/completions HTTP/1.1" 200' in log
