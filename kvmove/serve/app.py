"""The OpenAI-compatible HTTP API over a ``Router`` (FastAPI; uvicorn serves it).

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as Server-Sent
Events ending in ``data: [DONE]``, or one JSON body), ``GET /v1/models``, ``/health``,
``/metrics``. Bad requests get 400/404 with OpenAI's error body; an error after streaming
began is an ``error`` event, which the official client raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from kvmove.serve.router import Handle, Router

__all__ = ["create_app"]


class CompletionBody(BaseModel):
    model: str
    prompt: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatBody(CompletionBody):
    prompt: str = ""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def _error_body(message: str, kind: str, param: str | None = None,
                code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def chat_prompt(messages: list[Message]) -> str:
    """A plain template: each message as ``<|role|>`` and its text, then the assistant's."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


class TextStream:
    """Token ids in, text deltas out: holds back an unfinished UTF-8 character and any text
    that may be the start of a stop string, so nothing sent is ever taken back."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        safe = len(text)
        for s in self.stop:  # a whole stop string: nothing from it on is ever sent
            found = text.find(s)
            if found >= 0:
                safe = min(safe, found)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the worker's final text (cut before a stop string)."""
        delta = final_text[self.sent:] if len(final_text) > self.sent else ""
        self.sent = max(self.sent, len(final_text))
        return delta


def create_app(router: Router, tokenizer: Any, model_name: str, max_positions: int,
               manage_router: bool = True) -> FastAPI:
    """The app; with ``manage_router`` its lifespan starts and stops the router."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_router:
            await router.start()
        yield
        if manage_router:
            await router.stop()

    app = FastAPI(title="kvmove-serve", lifespan=lifespan)
    created = int(time.time())
    config = router.config

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = first.get("loc", ())[1:]
        param = ".".join(str(p) for p in where) if where and isinstance(where[0], str) else None
        message = first.get("msg", "invalid request")
        return JSONResponse(_error_body(f"{param}: {message}" if param else
                                        f"the body is not a valid request: {message}",
                                        "invalid_request_error", param), status_code=400)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(_error_body(str(error), error.kind, error.param, error.code),
                            status_code=error.status)

    def check(body: CompletionBody, prompt: list[int], max_tokens: int) -> None:
        if body.model != model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                                f"{model_name!r}", param="model", code="model_not_found")
        if len(prompt) + max_tokens > max_positions:
            raise APIError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} "
                                f"exceeds the model's context of {max_positions} tokens",
                           param="prompt", code="context_length_exceeded")
        need = -(-(len(prompt) + max_tokens) // config.block_size)
        if need > config.num_blocks:
            raise APIError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} "
                                f"needs {need} KV blocks, a worker has {config.num_blocks}",
                           param="prompt", code="context_length_exceeded")

    def submit(body: CompletionBody, text: str, max_tokens: int) -> tuple[Handle, list[str]]:
        prompt = tokenizer.encode(text)
        check(body, prompt, max_tokens)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must not be empty", param="stop")
        params = {"max_tokens": max_tokens, "temperature": body.temperature,
                  "top_p": body.top_p, "seed": body.seed, "stop": stop,
                  "ignore_eos": body.ignore_eos}
        return router.submit(prompt, params), stop

    async def events(handle: Handle) -> AsyncIterator[tuple]:
        while True:
            try:
                event = await asyncio.wait_for(handle.events.get(), config.request_timeout)
            except asyncio.TimeoutError:
                router.abort(handle, f"no token for {config.request_timeout:g} s")
                event = await handle.events.get()
            yield event
            if event[0] == "end":
                return

    async def run(body: CompletionBody, text: str, max_tokens: int, chat: bool) -> Response:
        handle, stop = submit(body, text, max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + handle.rid
        if body.stream:
            return StreamingResponse(sse(handle, stop, rid, chat), media_type="text/event-stream")
        texts = TextStream(tokenizer, stop)
        count = 0
        async for event in events(handle):
            if event[0] == "token":
                texts.push(event[1])
                count += 1
                continue
            _, reason, final, error = event
            if reason == "abort":
                raise APIError(500, error or "request aborted", kind="server_error")
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": final}
            else:
                choice["text"] = final
            return JSONResponse({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(handle.prompt), "completion_tokens": count,
                          "total_tokens": len(handle.prompt) + count}})
        raise APIError(500, "request ended without a result", kind="server_error")

    async def sse(handle: Handle, stop: list[str], rid: str, chat: bool) -> AsyncIterator[str]:
        texts = TextStream(tokenizer, stop)
        kind = "chat.completion.chunk" if chat else "text_completion"
        first = True

        def chunk(text: str, reason: str | None) -> str:
            nonlocal first
            if chat:
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
            first = False
            body = {"id": rid, "object": kind, "created": created, "model": model_name,
                    "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            async for event in events(handle):
                if event[0] == "token":
                    yield chunk(texts.push(event[1]), None)
                    continue
                _, reason, final, error = event
                if reason == "abort":
                    yield f"data: {json.dumps(_error_body(error or 'aborted', 'server_error'))}\n\n"
                    return
                yield chunk(texts.finish(final), reason)
                yield "data: [DONE]\n\n"
        finally:
            if not handle.done:  # the client went away
                router.abort(handle, "the client disconnected")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Response:
        return await run(body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Response:
        return await run(body, chat_prompt(body.messages),
                         body.max_completion_tokens or body.max_tokens, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "kvmove"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        report = router.health()
        return JSONResponse(report, status_code=200 if report["status"] != "down" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
