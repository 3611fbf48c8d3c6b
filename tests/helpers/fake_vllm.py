"""Stand-ins for vLLM servers, for ``test_vllm_proxy.py``: real uvicorn servers on loopback
that record every request and answer in vLLM's shapes (completions and chat, JSON and SSE), a
prefill call (``do_remote_decode``) with ``kv_transfer_params`` naming a kvmove address.

All of them run on one event loop in one thread (``FakeFleet``): a request whose bytes arrive
first is handled first, so the order of ``FakeFleet.log`` is the order the proxy sent in.

Prompts steer them: ``"refuse"`` is answered 400; ``"hang"`` answers after ``HANG_SECONDS``;
``"slow"`` streams a chunk every 0.1 s and records whether the stream was cut
(``FakeVLLM.cut``); ``"fail-push"`` is answered 500 when it is a push prefill. A push decode
request waits (at most ``PAIR_SECONDS``) until its prefill request has arrived: the proxy
must not wait for the decode's answer before it sends the prefill.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

WORDS = ("Hello", " from", " a", " fake", " vLLM")
HANG_SECONDS = 4.0
PAIR_SECONDS = 10.0
START_SECONDS = 20.0


@dataclass
class Record:
    """One request a stand-in got, in arrival order across the fleet (``seq``)."""

    seq: int
    server: str
    path: str
    request_id: str | None
    body: dict


@dataclass(eq=False)
class FakeVLLM:
    name: str
    port: int = 0
    cut: list[bool] = field(default_factory=list)  # per "slow" stream: cut short?

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_params(self) -> dict:
        """What this prefill returns: vLLM's remote-decode params, a kvmove address."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3], "remote_engine_id": f"engine-{self.name}",
                "remote_host": "10.0.0.7", "remote_port": self.port + 1, "tp_size": 1}


def _text(body: dict) -> list[str]:
    return list(WORDS[:max(1, min(len(WORDS), int(body.get("max_tokens") or 16)))])


def _choice(chat: bool, text: str, reason: str | None, stream: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    key = "delta" if stream else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}


class FakeFleet:
    """Stand-ins, served from one thread; a context manager."""

    def __init__(self, *servers: FakeVLLM) -> None:
        self.servers = {s.name: s for s in servers}
        self.log: list[Record] = []
        self._lock = threading.Lock()
        self._prefilled: dict[str, asyncio.Event] = {}
        self._uvicorns: list[uvicorn.Server] = []
        self._sockets = []
        for s in servers:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            s.port = sock.getsockname()[1]
            self._sockets.append(sock)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not all(u.started for u in self._uvicorns) or len(self._uvicorns) < len(servers):
            assert time.monotonic() < deadline, "fake vLLM servers not started"
            time.sleep(0.02)

    def requests(self, server: str | None = None) -> list[Record]:
        with self._lock:
            return [r for r in self.log if server is None or r.server == server]

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    async def _serve(self) -> None:
        for fake, _sock in zip(self.servers.values(), self._sockets):
            config = uvicorn.Config(self._app(fake), log_level="warning", lifespan="off")
            self._uvicorns.append(uvicorn.Server(config))
        await asyncio.gather(*(u.serve(sockets=[s])
                               for u, s in zip(self._uvicorns, self._sockets)))

    def _record(self, fake: FakeVLLM, request: Request, body: dict) -> None:
        with self._lock:
            self.log.append(Record(len(self.log), fake.name, request.url.path,
                                   request.headers.get("x-request-id"), body))

    def _pair(self, transfer_id: str) -> asyncio.Event:
        return self._prefilled.setdefault(transfer_id, asyncio.Event())

    def _app(self, fake: FakeVLLM) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = await request.json()
            self._record(fake, request, body)
            params = body.get("kv_transfer_params") or {}
            chat = request.url.path.endswith("chat/completions")
            prompt = body.get("prompt") or json.dumps(body.get("messages"))
            if "refuse" in prompt:
                return JSONResponse({"object": "error", "message": "prompt too long",
                                     "type": "BadRequestError", "code": 400}, status_code=400)
            if "hang" in prompt:
                await asyncio.sleep(HANG_SECONDS)
            if params.get("transfer_mode") == "push":
                event = self._pair(params["kvmove_transfer_id"])
                if params.get("do_remote_decode"):
                    event.set()
                    if "fail-push" in prompt:
                        return JSONResponse({"error": "push refused"}, status_code=500)
                else:
                    await asyncio.wait_for(event.wait(), PAIR_SECONDS)
            words = _text(body)
            if body.get("stream"):
                return StreamingResponse(self._chunks(fake, chat, words, "slow" in prompt),
                                         media_type="text/event-stream")
            answer = {"id": "cmpl-fake", "object": "text_completion", "model": body.get("model"),
                      "choices": [_choice(chat, "".join(words), "length", False)],
                      "usage": {"prompt_tokens": 3, "completion_tokens": len(words),
                                "total_tokens": 3 + len(words)},
                      "kv_transfer_params": fake.kv_params()
                      if params.get("do_remote_decode") else None}
            return JSONResponse(answer)

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny", "object": "model",
                                                "owned_by": fake.name}]}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        return app

    async def _chunks(self, fake: FakeVLLM, chat: bool, words: list[str],
                      slow: bool) -> AsyncIterator[str]:
        count = 50 if slow else len(words)
        index = len(fake.cut)
        if slow:
            fake.cut.append(True)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i in range(count):
            if slow:
                await asyncio.sleep(0.1)
            chunk: dict[str, Any] = {"id": "cmpl-fake", "object": obj, "model": "tiny",
                                     "choices": [_choice(chat, words[i % len(words)],
                                                         "length" if i == count - 1 else None,
                                                         True)]}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
        if slow:
            fake.cut[index] = False

    def close(self) -> None:
        for u in self._uvicorns:
            u.should_exit = True
        self._thread.join(START_SECONDS)
        assert not self._thread.is_alive(), "fake vLLM servers did not stop"

    def __enter__(self) -> FakeFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
