"""The OpenAI API's requests and errors: request bodies, their limits, and OpenAI's error body
for every refusal (FastAPI's own ``{"detail": ...}`` never reaches a client).

Every limit names itself in its 400 (``docs/serving.md`` has the table): at most
``MAX_STOP_STRINGS`` stop strings of at most ``MAX_STOP_CHARS`` characters (1,000 stop strings
of 50 characters cost 12.4 s of router CPU for one request before the incremental
detokenizer, and nothing bounded them); ``n`` 1; ``max_tokens`` within the context; text that
is valid Unicode (a lone surrogate, which JSON can carry, cannot be encoded: it was a 500).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

__all__ = ["APIError", "ChatBody", "CompletionBody", "MAX_STOP_CHARS", "MAX_STOP_STRINGS",
           "Message", "error_body", "error_response", "install_error_handlers"]

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class APIError(Exception):
    """A refusal with OpenAI's error body: ``status``, ``kind`` (its ``type``), the ``param``
    at fault and a ``code``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(str(error), error.kind, error.param, error.code),
                        status_code=error.status, headers=headers)


def _unicode(text: str) -> str:
    """``text``, if it can be encoded (JSON's ``\\ud800`` decodes to a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError("unicode", "is not valid Unicode: a lone surrogate at "
                                  "character {position}", {"position": error.start}) from None
    return text


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionBody(BaseModel):
    model: str
    prompt: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)  # -> list[str]
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str) -> str:
        return _unicode(prompt)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise PydanticCustomError("stop_limit", "at most {limit} stop strings, got {count}",
                                      {"limit": MAX_STOP_STRINGS, "count": len(stops)})
        for i, s in enumerate(stops):
            if not s:
                raise PydanticCustomError("stop_empty", "stop strings must not be empty "
                                          "(stop[{i}])", {"i": i})
            if len(s) > MAX_STOP_CHARS:
                raise PydanticCustomError("stop_limit", "a stop string is at most {limit} "
                                          "characters, stop[{i}] has {count}",
                                          {"limit": MAX_STOP_CHARS, "i": i, "count": len(s)})
            _unicode(s)
        return stops

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int) -> int:
        if n != 1:
            raise PydanticCustomError("n", "only n=1 is supported, got {n}", {"n": n})
        return n

    @model_validator(mode="after")
    def _check_stream_options(self) -> CompletionBody:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options is only allowed with "
                                      "stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str

    @field_validator("content")
    @classmethod
    def _check_content(cls, content: str) -> str:
        return _unicode(content)


class ChatBody(CompletionBody):
    prompt: str = ""
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _param(error: dict) -> str | None:
    """The body field an error is about (``stop``, ``messages.0.content``), if any."""
    if error.get("type") == "stream_options":  # a check of the whole body, about this field
        return "stream_options"
    where = error.get("loc", ())[1:]
    if not where or not isinstance(where[0], str):
        return None
    return ".".join(str(p) for p in where)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI's error body for invalid bodies (400), ``APIError`` and every HTTP error
    Starlette raises itself: unknown routes (404), wrong methods (405), unparsable bodies
    (400), and bodies over the limit (413, ``admission.py``)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = error.errors()[0] if error.errors() else {}
        param = _param(first)
        message = first.get("msg", "invalid request")
        return JSONResponse(error_body(f"{param}: {message}" if param else
                                       f"the body is not a valid request: {message}",
                                       "invalid_request_error", param), status_code=400)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})",
                   405: f"Method not allowed ({where})"}.get(error.status_code, error.detail)
        return error_response(APIError(error.status_code, str(message)), error.headers)
