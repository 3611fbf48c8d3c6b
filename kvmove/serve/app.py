"""The OpenAI-compatible HTTP API over a ``Router`` (FastAPI; uvicorn serves it).

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as Server-Sent
Events ending in ``data: [DONE]``, with ``stream_options.include_usage`` a last chunk of
usage, or one JSON body), ``GET /v1/models``, ``/health``, ``/metrics``. Requests pass
``admission.py`` (Host, body size, pending count) and ``api.py``'s checks first; every refusal
is OpenAI's error body; an error after streaming began is an ``error`` event, which the
official client raises.

The event loop is never held by one request's text: a prompt longer in bytes than the
context could hold is refused before it is tokenized, tokenizing (and rendering a chat
template) runs in a worker thread, and the text streamed back is decoded one token at a time
(``Detokenizer``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmove.engine.detokenizer import Detokenizer
from kvmove.engine.request import SamplingParams
from kvmove.engine.tokenizer import ByteTokenizer
from kvmove.serve.admission import Admission
from kvmove.serve.api import APIError, ChatBody, CompletionBody, error_body, install_error_handlers
from kvmove.serve.chat_template import ChatTemplate, TemplateError, load_chat_template
from kvmove.serve.handle import Handle
from kvmove.serve.router import Router

__all__ = ["MAX_BYTES_PER_TOKEN", "create_app"]

# A prompt longer than the context times this many bytes is refused before it is tokenized.
# Exact for the byte tokenizer (1); for others a limit (no vocabulary we know has tokens of
# 64 bytes of text on average), which a prompt of pathological whitespace may hit.
MAX_BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class Model:
    """What the API knows of the model: its name, tokenizer, chat template and context."""

    name: str
    tokenizer: Any
    template: ChatTemplate
    max_positions: int

    @property
    def bytes_per_token(self) -> int:
        return 1 if isinstance(self.tokenizer, ByteTokenizer) else MAX_BYTES_PER_TOKEN


def _check_before_tokenizing(model: Model, body: CompletionBody, text: str,
                             limit: tuple[str, int], param: str) -> None:
    """What is refused without tokenizing: another model, a ``max_tokens`` (``limit``: its
    parameter's name and value) that leaves no room for a prompt, a prompt (``param``: its
    text) of more bytes than the context could hold."""
    name, max_tokens = limit
    if body.model != model.name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                            f"{model.name!r}", param="model", code="model_not_found")
    if max_tokens >= model.max_positions:
        raise APIError(400, f"{name} {max_tokens} leaves no room for a prompt in the "
                            f"model's context of {model.max_positions} tokens (at most "
                            f"{model.max_positions - 1})", param=name,
                       code="context_length_exceeded")
    nbytes, most = len(text.encode("utf-8")), model.max_positions * model.bytes_per_token
    if nbytes > most:
        raise APIError(400, f"prompt of {nbytes} bytes cannot fit the model's context of "
                            f"{model.max_positions} tokens (at most {model.bytes_per_token} "
                            f"bytes a token here: {most} bytes)", param=param,
                       code="context_length_exceeded")


def _check_context(model: Model, blocks: tuple[int, int], prompt: list[int],
                   max_tokens: int) -> None:
    """The prompt's tokens and ``max_tokens`` fit the context and a worker's blocks."""
    block_size, num_blocks = blocks
    total = len(prompt) + max_tokens
    if total > model.max_positions:
        raise APIError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} "
                            f"exceeds the model's context of {model.max_positions} tokens",
                       param="prompt", code="context_length_exceeded")
    need = -(-total // block_size)
    if need > num_blocks:
        raise APIError(400, f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} "
                            f"needs {need} KV blocks, a worker has {num_blocks}",
                       param="prompt", code="context_length_exceeded")


def _chat_ids(model: Model, body: ChatBody) -> list[int]:
    """The chat's prompt ids (a worker thread's job: rendering and tokenizing take time)."""
    try:
        text = model.template.render([m.model_dump() for m in body.messages])
    except TemplateError as error:
        raise APIError(400, str(error), param="messages") from None
    return model.tokenizer.encode(text, add_bos=model.template.add_bos)


class _Completion:
    """One request's response: JSON, or a stream of SSE chunks."""

    def __init__(self, router: Router, model: Model, handle: Handle, body: CompletionBody,
                 chat: bool, created: int) -> None:
        self.router, self.model, self.handle, self.body = router, model, handle, body
        self.chat, self.created = chat, created
        self.rid = ("chatcmpl-" if chat else "cmpl-") + handle.rid
        self.texts = Detokenizer(model.tokenizer, handle.params.stop)
        self.sent = 0  # characters of text sent so far
        self.count = 0  # tokens received
        self.first = True  # no chunk sent yet (a chat's first names the role)

    async def events(self) -> AsyncIterator[tuple]:
        timeout = self.router.config.request_timeout
        while True:
            try:
                event = await asyncio.wait_for(self.handle.events.get(), timeout)
            except TimeoutError:
                self.router.abort(self.handle, f"no token for {timeout:g} s")
                event = await self.handle.events.get()
            yield event
            if event[0] == "end":
                return

    def push(self, token: int) -> str:
        self.count += 1
        delta = self.texts.push(token)
        self.sent += len(delta)
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the worker's final text (cut before a stop string): the text held
        back, and whatever the worker decoded past what streamed here."""
        delta = final_text[self.sent:]
        self.sent += len(delta)
        return delta

    def usage(self) -> dict[str, int]:
        n = len(self.handle.prompt)
        return {"prompt_tokens": n, "completion_tokens": self.count,
                "total_tokens": n + self.count}

    async def json(self) -> JSONResponse:
        async for event in self.events():
            if event[0] == "token":
                self.count += 1
                continue
            _, reason, final, error = event
            if reason == "abort":
                raise APIError(500, error or "request aborted", kind="server_error")
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": final}
            else:
                choice["text"] = final
            return JSONResponse({
                "id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model.name, "choices": [choice],
                "usage": self.usage()})
        raise APIError(500, "request ended without a result", kind="server_error")

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.rid, "object": "chat.completion.chunk" if self.chat else
            "text_completion", "created": self.created, "model": self.model.name,
            "choices": choices}
        if self.body.include_usage:  # OpenAI: null on every chunk but the last
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(self, text: str, reason: str | None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
        delta: dict[str, Any] = {"content": text}
        if self.first:
            delta["role"] = "assistant"
        self.first = False
        return {"index": 0, "delta": delta, "finish_reason": reason}

    async def sse(self) -> AsyncIterator[str]:
        try:
            async for event in self.events():
                if event[0] == "token":
                    yield self.chunk([self.choice(self.push(event[1]), None)])
                    continue
                _, reason, final, error = event
                if reason == "abort":
                    yield f"data: {json.dumps(error_body(error or 'aborted', 'server_error'))}\n\n"
                    return
                yield self.chunk([self.choice(self.finish(final), reason)])
                if self.body.include_usage:
                    yield self.chunk([], self.usage())
                yield "data: [DONE]\n\n"
        finally:
            if not self.handle.done:  # the client went away
                self.router.abort(self.handle, "the client disconnected")


def create_app(router: Router, tokenizer: Any, model_name: str, max_positions: int,
               manage_router: bool = True, tokenizer_dir: str | None = None) -> FastAPI:
    """The app; with ``manage_router`` its lifespan starts and stops the router.
    ``tokenizer_dir`` holds the chat template (None: the fallback, ``chat_template.py``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_router:
            await router.start()
        yield
        if manage_router:
            await router.stop()

    app = FastAPI(title="kvmove-serve", lifespan=lifespan)
    config = router.config
    app.add_middleware(Admission, hosts=config.hosts(), max_body_bytes=config.max_body_bytes,
                       body_timeout=config.connections.body_timeout,
                       max_pending=config.max_pending, metrics=router.metrics)
    install_error_handlers(app)
    model = Model(model_name, tokenizer, load_chat_template(tokenizer_dir), max_positions)
    created = int(time.time())
    blocks = (config.block_size, config.num_blocks)

    async def run(body: CompletionBody, limit: tuple[str, int]) -> Response:
        chat = body if isinstance(body, ChatBody) else None  # the chat endpoint's body
        text = "".join(m.content for m in chat.messages) if chat is not None else body.prompt
        _check_before_tokenizing(model, body, text, limit,
                                 "messages" if chat is not None else "prompt")
        max_tokens = limit[1]
        if chat is not None:
            prompt = await asyncio.to_thread(_chat_ids, model, chat)
        else:
            prompt = await asyncio.to_thread(tokenizer.encode, body.prompt)
        _check_context(model, blocks, prompt, max_tokens)
        stop = body.stop or ()  # a list by now (CompletionBody's validator); typed as sent
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature,
                                top_p=body.top_p, seed=body.seed, stop=tuple(stop),
                                ignore_eos=body.ignore_eos)
        completion = _Completion(router, model, router.submit(prompt, params), body,
                                 chat is not None, created)
        if body.stream:
            return StreamingResponse(completion.sse(), media_type="text/event-stream")
        return await completion.json()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Response:
        return await run(body, ("max_tokens", body.max_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Response:
        limit = (("max_completion_tokens", body.max_completion_tokens)
                 if body.max_completion_tokens else ("max_tokens", body.max_tokens))
        return await run(body, limit)

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
