"""``kvmove-serve`` end to end (``kvmove/serve``): real server processes, the official ``openai``
client.

Each configuration runs as one server shared by the module (a start costs seconds: the server
and every worker import torch): ``colocated`` (two workers, whole prompts), ``chunked`` (one
worker, prefill in chunks of 32 tokens) and ``disagg`` (a prefill and a decode worker, KV
streamed layer by layer over kvmove, prefill chunks of 32). The reference is the engine in
this process: the tiny preset with seed 0 (the weights every worker builds; a byte tokenizer,
one token per UTF-8 byte after BOS), greedy, whole prompts, one batch. Every mode gives its
text for prompts of 1 to 400 bytes, shorter and longer than a chunk.

Then the API's promises: streaming and not, completions and chat, usage, seeded sampling,
stop strings, 32 concurrent streams, OpenAI error bodies for bad requests, ``/health`` and
``/metrics``; the command line: a port in use and bad options fail cleanly. Last, the tests
that damage or stop a server (they take it from the pool, so the shared servers start once):
a worker SIGKILLed mid-stream ends that stream with an error, never a hang; a client that goes
away frees its worker; SIGINT / SIGTERM stop the server and every worker, promptly even with
streams in flight. Every wait has a deadline; no process outlives its test module.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import openai
import pytest

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import FinishReason, Request, SamplingParams
from kvmove.engine.role import Role
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.tokenizer import ByteTokenizer
from kvmove.engine.worker import EngineWorker
from kvmove.serve.worker_main import _timeline

from helpers.serve import (
    GONE_SECONDS,
    START_SECONDS,
    TAG_VARIABLE,
    WORKDIR,
    Server,
    ServerPool,
    process_alive,
    tagged_pids,
    wait_until,
)
from helpers.threads import cpus_of_threads

MODEL = "tiny"
TINY = MODEL_PRESETS[MODEL]
BLOCK = 16            # kvmove-serve's --block-size default
NUM_BLOCKS = 2048     # and --num-blocks
CHUNK = 32
MAX_TOKENS = 32
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # exactly max_tokens tokens
LONG_TOKENS = 2000    # a stream that outlasts whatever the test does to it (seconds)
FULL_CONTEXT_TOKENS = 4000  # "Hello" (6 tokens) + 4,000 of the 4,096 positions: 15+ s alone
BATCH_SECONDS = 120.0  # a batch of concurrent requests
ERROR_SECONDS = 5.0   # a killed worker's stream ends with an error within this
SHUTDOWN_SECONDS = 15.0  # SIGINT / SIGTERM to exit code
# The shared servers do not restart dead workers (--no-restart): several tests kill one and
# check what a dead worker does to the rest. "disagg-restart" has kvmove-serve's default.
SERVERS = {
    "colocated": ("--mode", "colocated", "--workers", "2", "--no-restart"),
    "chunked": ("--mode", "chunked", "--workers", "1", "--chunk-size", str(CHUNK),
                "--no-restart"),
    "disagg": ("--mode", "disagg", "--prefill", "1", "--decode", "1",
               "--chunk-size", str(CHUNK), "--no-restart"),
    "single": ("--mode", "colocated", "--workers", "1", "--no-restart"),
    "disagg-restart": ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                       "--chunk-size", str(CHUNK)),
    "disagg-store": ("--mode", "disagg", "--chunk-size", str(CHUNK), "--store-host-gb", "0.01",
                     "--no-restart"),
}
TOKENIZER = ByteTokenizer(TINY.bos_token_id, TINY.eos_token_id)
T = TypeVar("T")


def _text(num_bytes: int, seed: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz ,."
    return "".join(letters[(i * i + 7 * i + 3 * seed) % len(letters)] for i in range(num_bytes))


# 2 to 401 tokens: under and over a block (16) and a chunk (32), multi-byte characters
PROMPTS = ["a", "Hello, world!", "héllo wörld ✓ ünïcode ☃", _text(30, 1), _text(31, 2),
           _text(100, 3), _text(257, 4), _text(400, 5)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
CHAT_TEXT = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in CHAT) + "<|assistant|>\n"


def num_tokens(text: str) -> int:
    return len(TOKENIZER.encode(text))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy tokens (``MAX_TOKENS``, EOS ignored) of every prompt, from the engine here."""
    model = LlamaForCausalLM.random(TINY, seed=0)
    worker = EngineWorker(model, num_blocks=512, block_size=BLOCK,
                          scheduler=SchedulerConfig(chunk_size=None, prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = {p: Request(f"r{i}", TOKENIZER.encode(p), params)
                for i, p in enumerate([*PROMPTS, CHAT_TEXT])}
    for request in requests.values():
        worker.add_request(request)
    worker.run()
    return {p: r.output for p, r in requests.items()}


def text_of(tokens: list[int]) -> str:
    return TOKENIZER.decode(tokens)


@pytest.fixture(scope="module")
def servers() -> Iterator[ServerPool]:
    pool = ServerPool(SERVERS)
    yield pool
    pool.close()  # fails if a server ignored SIGTERM or left a process behind


@pytest.fixture
def own(servers: ServerPool) -> Iterator[Callable[[str], Server]]:
    """``own(name)``: the pool's server of that configuration, the test's to damage or stop;
    closed after the test, which fails if any process of it is left."""
    owned: list[Server] = []

    def take(name: str) -> Server:
        owned.append(servers.take(name))
        return owned[-1]

    yield take
    for server in owned:
        server.close()


def run_async(coroutine: Coroutine[Any, Any, T], seconds: float = BATCH_SECONDS) -> T:
    """Runs ``coroutine`` to its end, or fails after ``seconds``."""
    return asyncio.run(asyncio.wait_for(coroutine, seconds))


# --- the official client: completions, chat, models --------------------------------------------

def test_models_list_names_the_served_model(servers: ServerPool) -> None:
    models = servers.get("colocated").client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "kvmove"


@pytest.mark.parametrize("mode", ["colocated", "chunked", "disagg"])
def test_greedy_text_equals_the_engine_in_every_mode(servers: ServerPool,
                                                     reference: dict[str, list[int]],
                                                     mode: str) -> None:
    """All prompts at once (one batch on the server): each text is the engine's, token for
    token as far as text shows, and usage counts BOS + one token per byte."""
    server = servers.get(mode)

    async def complete_all() -> list:
        async with server.async_client() as client:
            return await asyncio.gather(*(
                client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, **GREEDY)
                for p in PROMPTS))

    for prompt, result in zip(PROMPTS, run_async(complete_all())):
        choice = result.choices[0]
        assert choice.text == text_of(reference[prompt]), (mode, len(prompt))
        assert choice.finish_reason == "length"
        n = num_tokens(prompt)
        assert (result.usage.prompt_tokens, result.usage.completion_tokens,
                result.usage.total_tokens) == (n, MAX_TOKENS, n + MAX_TOKENS)


def test_completion_stream_sends_a_chunk_per_token_then_the_finish(
        servers: ServerPool, reference: dict[str, list[int]]) -> None:
    client, prompt, m = servers.get("colocated").client(), PROMPTS[5], 20
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=m, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=m,
                                            stream=True, **GREEDY))
    assert len(chunks) == m + 1  # one per token, and the final one with finish_reason
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert {c.object for c in chunks} == {"text_completion"}
    assert [c.choices[0].finish_reason for c in chunks] == [None] * m + ["length"]
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == whole.choices[0].text == text_of(reference[prompt][:m])


def test_chat_completion_streamed_and_not(servers: ServerPool,
                                          reference: dict[str, list[int]]) -> None:
    """Chat on the disaggregated server: the template's tokens in usage, both max_tokens
    names, the role in the first delta."""
    client, m = servers.get("disagg").client(), 12
    whole = client.chat.completions.create(model=MODEL, messages=CHAT,
                                           max_completion_tokens=m, **GREEDY)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == text_of(reference[CHAT_TEXT][:m])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        num_tokens(CHAT_TEXT), m)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=m,
                                                 stream=True, **GREEDY))
    assert len(chunks) == m + 1
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks] == [None] * m + ["length"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_stream_include_usage_sends_a_last_chunk_of_usage(servers: ServerPool) -> None:
    """``stream_options.include_usage``, as OpenAI sends it: every chunk has ``usage`` null
    but an extra last one, before ``[DONE]``, with no choices and the request's usage."""
    client, m = servers.get("colocated").client(), 6
    for create, kwargs in [(client.completions.create, {"prompt": PROMPTS[1]}),
                           (client.chat.completions.create, {"messages": CHAT})]:
        chunks = list(create(model=MODEL, max_tokens=m, stream=True,
                             stream_options={"include_usage": True}, **kwargs, **GREEDY))
        *tokens, last = chunks
        assert len(tokens) == m + 1 and all(c.usage is None for c in tokens)
        assert last.choices == [] and last.usage.completion_tokens == m
        assert last.usage.total_tokens == last.usage.prompt_tokens + m
    plain = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                           **GREEDY))
    assert len(plain) == 3 and all(c.usage is None for c in plain)


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_seeded_sampling_reproduces(servers: ServerPool, reference: dict[str, list[int]],
                                    mode: str) -> None:
    client = servers.get(mode).client()
    params = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0.9,
              "top_p": 0.95, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**params, seed=1234)
    again = client.completions.create(**params, seed=1234)
    streamed = list(client.completions.create(**params, seed=1234, stream=True))
    other = client.completions.create(**params, seed=4321)
    text = first.choices[0].text
    assert again.choices[0].text == text
    assert "".join(c.choices[0].text for c in streamed) == text
    assert first.usage.completion_tokens == 24 and len(streamed) == 25
    assert other.choices[0].text != text  # the seed matters: 24 draws from 320 tokens
    assert text != text_of(reference[PROMPTS[3]][:24])  # and it is not greedy


def _stop_case(reference: dict[str, list[int]]) -> tuple[str, str, str, int]:
    """(prompt, stop, expected text, tokens up to and including the stop's last): the first
    two-character ASCII string of a greedy output that occurs there once."""
    for prompt in PROMPTS:
        tokens = reference[prompt]
        text = text_of(tokens)
        for i in range(3, len(text) - 1):
            stop = text[i:i + 2]
            if stop.isascii() and stop.isprintable() and text.find(stop) == i:
                k = next(k for k in range(1, len(tokens) + 1) if stop in text_of(tokens[:k]))
                return prompt, stop, text[:i], k
    raise AssertionError("no greedy output holds a printable ASCII pair")


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_stop_string_ends_the_text_before_it(servers: ServerPool,
                                            reference: dict[str, list[int]],
                                            mode: str) -> None:
    prompt, stop, expected, k = _stop_case(reference)
    client = servers.get(mode).client()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      stop=stop, **GREEDY)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == k
    chunks = list(client.completions.create(model=MODEL, prompt=prompt,
                                            max_tokens=MAX_TOKENS, stop=["\x00never", stop],
                                            stream=True, **GREEDY))
    assert [c.choices[0].finish_reason for c in chunks] == [None] * k + ["stop"]
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == expected, f"stop {stop!r}: the stream sent {streamed!r}"


def test_32_concurrent_streams_each_get_every_token(servers: ServerPool,
                                                    reference: dict[str, list[int]]) -> None:
    """32 streams at once through prefill and decode, of 8 to 32 tokens each."""
    server = servers.get("disagg")
    cases = [(PROMPTS[i % len(PROMPTS)], 8 + (i * 5) % 25) for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str, m: int) -> list:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=m,
                                                 stream=True, **GREEDY)
        return [chunk async for chunk in stream]

    async def all_streams() -> list[list]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in cases))

    streams = run_async(all_streams())
    for (prompt, m), chunks in zip(cases, streams):
        assert len(chunks) == m + 1, (len(prompt), m)
        assert [c.choices[0].finish_reason for c in chunks] == [None] * m + ["length"]
        assert "".join(c.choices[0].text for c in chunks) == text_of(reference[prompt][:m])
    assert len({chunks[0].id for chunks in streams}) == len(cases)


# --- bad requests: 4xx with OpenAI's error body, and the server goes on -----------------------

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
COMPLETIONS, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = {  # id: (path, body, status, param, code)
    "no-model": (COMPLETIONS, {"prompt": "hi"}, 400, "model", None),
    "no-prompt": (COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    "no-messages": (CHAT_PATH, {"model": MODEL}, 400, "messages", None),
    "empty-messages": (CHAT_PATH, {"model": MODEL, "messages": []}, 400, "messages", None),
    "max-tokens-0": (COMPLETIONS, {**GOOD, "max_tokens": 0}, 400, "max_tokens", None),
    "max-tokens-negative": (COMPLETIONS, {**GOOD, "max_tokens": -5}, 400, "max_tokens", None),
    "chat-max-tokens-0": (CHAT_PATH, {"model": MODEL, "messages": CHAT, "max_tokens": 0}, 400,
                          "max_tokens", None),
    "temperature-negative": (COMPLETIONS, {**GOOD, "temperature": -0.5}, 400, "temperature",
                             None),
    "top-p-0": (COMPLETIONS, {**GOOD, "top_p": 0}, 400, "top_p", None),
    "seed-negative": (COMPLETIONS, {**GOOD, "seed": -1}, 400, "seed", None),
    "empty-stop": (COMPLETIONS, {**GOOD, "stop": ""}, 400, "stop", None),
    # the tiny preset has 4096 positions; the prompt takes one more for BOS
    "prompt-over-context": (COMPLETIONS, {**GOOD, "prompt": "x" * 4096, "max_tokens": 1}, 400,
                            "prompt", "context_length_exceeded"),
    "prompt-plus-max-tokens-over-context": (
        COMPLETIONS, {**GOOD, "prompt": "x" * 4000, "max_tokens": 96}, 400, "prompt",
        "context_length_exceeded"),
    "unknown-model": (COMPLETIONS, {**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    "stream-options-without-stream": (COMPLETIONS, {**GOOD, "stream_options": {
        "include_usage": True}}, 400, "stream_options", None),
}


def _assert_served(server: Server) -> None:
    """(``ignore_eos``: sampled at temperature 1, the tiny model's first token is EOS about one
    time in 258, and the answer then has 1 token.)"""
    response = server.post(COMPLETIONS, json={**GOOD, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS.values(),
                         ids=BAD_REQUESTS.keys())
def test_a_bad_request_gets_an_openai_error_body(servers: ServerPool, path: str, body: dict,
                                                 status: int, param: str,
                                                 code: str | None) -> None:
    server = servers.get("colocated")
    response = server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                              code)
    assert param in error["message"]
    _assert_served(server)


def test_a_prompt_that_fills_the_context_exactly_is_served(servers: ServerPool) -> None:
    response = servers.get("colocated").post(
        COMPLETIONS, json={**GOOD, "prompt": "x" * 4092, "max_tokens": 3})  # 4093 + 3 = 4096
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": 4093, "completion_tokens": 3,
                                        "total_tokens": 4096}


@pytest.mark.parametrize("content", [b'{"model": "tiny", "prompt": ', b"[1, 2]", b"",
                                     b"not json"], ids=["truncated", "array", "empty", "text"])
def test_a_body_that_is_not_a_json_object_gets_400(servers: ServerPool, content: bytes) -> None:
    server = servers.get("colocated")
    response = server.post(COMPLETIONS, content=content,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] is None, f"param {error['param']!r}: no parameter is at fault"
    _assert_served(server)


def test_the_openai_client_raises_on_bad_requests(servers: ServerPool) -> None:
    server = servers.get("colocated")
    client = server.client()
    create = client.completions.create
    for kwargs, param in [({"max_tokens": 0}, "max_tokens"),
                          ({"max_tokens": -1}, "max_tokens"),
                          ({"temperature": -1.0}, "temperature"),
                          ({"top_p": 0.0}, "top_p"),
                          ({"prompt": "x" * 5000}, "prompt")]:
        with pytest.raises(openai.BadRequestError) as error:
            create(**{"model": MODEL, "prompt": "hi", "max_tokens": 2, **kwargs})
        assert error.value.status_code == 400 and error.value.param == param, kwargs
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as error:
        create(model="gpt-4", prompt="hi", max_tokens=2)
    assert error.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # the stream's request fails before streaming
        create(model=MODEL, prompt="hi", max_tokens=0, stream=True)
    assert create(model=MODEL, prompt="hi", max_tokens=2,
                  extra_body={"ignore_eos": True}).usage.completion_tokens == 2


# --- /health and /metrics -----------------------------------------------------------------------

def test_health_lists_every_worker(servers: ServerPool) -> None:
    server = servers.get("disagg")
    response = server.get("/health")
    assert response.status_code == 200
    report = response.json()
    assert (report["status"], report["mode"]) == ("ok", "disagg")
    workers = {w["name"]: w for w in report["workers"]}
    assert {name: w["role"] for name, w in workers.items()} == {"prefill-0": "prefill",
                                                                "decode-0": "decode"}
    for w in workers.values():
        assert w["alive"] and w["ready"] and process_alive(w["pid"]), w
    wait_until(lambda: all(w.get("free_blocks") == NUM_BLOCKS and w.get("running") == 0
                           for w in server.health()["workers"]), 5.0,
               "idle workers report every block free")


def test_metrics_count_latencies_queues_and_kv_bytes(servers: ServerPool) -> None:
    """Four requests through prefill and decode: one TTFT each, a gap per later token, and
    the KV of every prompt block handed over (``ceil(prompt / 16)`` blocks of K and V of
    every layer)."""
    server = servers.get("disagg")
    client = server.client()
    before = server.samples()
    prompts, m = PROMPTS[2:6], 6
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=m, **GREEDY)
    block_nbytes = TINY.kv_spec(BLOCK).bytes_per_block
    kv_nbytes = sum(-(-num_tokens(p) // BLOCK) for p in prompts) * block_nbytes

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return server.samples()[key] - before.get(key, 0.0)

    # the prefill worker's hand-off ends when decode acknowledges it: maybe after the response
    wait_until(lambda: delta("kvmove_kv_bytes_total") == kv_nbytes, 5.0,
               f"kvmove_kv_bytes_total grows by {kv_nbytes}")
    assert kv_nbytes > 0
    assert delta("kvmove_kv_transfer_seconds_count") == len(prompts)
    assert delta("kvmove_kv_exposed_seconds_count") == len(prompts)
    assert delta("kvmove_ttft_seconds_count") == len(prompts)
    assert delta("kvmove_itl_seconds_count") == len(prompts) * (m - 1)
    assert delta("kvmove_generated_tokens_total") == len(prompts) * m
    assert delta("kvmove_requests_total", outcome="length") == len(prompts)
    queues = [("kvmove_pool_queue_length", (("pool", pool),)) for pool in ("prefill", "decode")]
    wait_until(lambda: [server.samples()[q] for q in queues] == [0, 0], 5.0,
               "both pools' queues empty once every request is done")
    after = server.samples()
    for worker in ("prefill-0", "decode-0"):
        assert 0 < after["kvmove_worker_free_blocks", (("worker", worker),)] <= NUM_BLOCKS
        assert after["kvmove_worker_alive", (("worker", worker),)] == 1


def test_the_kv_handoff_timeline_is_ordered_and_measured(servers: ServerPool) -> None:
    """Each request's hand-off in ``kvmove_kv_handoff_stage_seconds`` (every moment after the
    prefill's last layer: non-negative, in causal order: the decode saw the KV in after the
    prefill's last layer message went out (``sent``: its send's completion, which the decode
    may see first: ``landed`` and ``sent`` come in either order, 75 and 95 us in one CI run),
    after that message arrived and after the first token was sampled, and stepped after) and
    ``kvmove_kv_handoff_seconds`` (to ``learned``), a share of each TTFT."""
    server = servers.get("disagg")
    client = server.client()
    before = server.samples()
    prompts = PROMPTS[4:7]
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return server.samples().get(key, 0.0) - before.get(key, 0.0)

    stages = ("sent", "sampled", "landed", "learned", "first_step")
    wait_until(lambda: all(delta("kvmove_kv_handoff_stage_seconds_count", stage=s) ==
                           len(prompts) for s in stages), 5.0,
               "every stage of every request's hand-off observed (the prefill's at its ack)")
    mean = {s: delta("kvmove_kv_handoff_stage_seconds_sum", stage=s) / len(prompts)
            for s in stages}
    assert all(0 <= seconds < 5.0 for seconds in mean.values()), mean
    assert mean["landed"] <= mean["learned"] <= mean["first_step"], mean
    assert mean["sent"] <= mean["learned"] and mean["sampled"] <= mean["learned"], mean
    assert delta("kvmove_kv_handoff_seconds_count") == len(prompts)
    assert delta("kvmove_kv_handoff_seconds_sum") == pytest.approx(
        mean["learned"] * len(prompts))
    assert delta("kvmove_kv_handoff_ttft_ratio_count") == len(prompts)
    assert 0 < delta("kvmove_kv_handoff_ttft_ratio_sum") < len(prompts)


def test_each_worker_reports_its_own_sides_moments_of_a_handoff() -> None:
    """A prefill reports ``sent`` and ``sampled`` of a request it handed off, and nothing of
    one whose hand-off failed (its first step came before its last layer: a negative stage);
    a decode its own three; a request with no hand-off (no last layer) nothing."""
    sent = Request("r", [1, 2, 3])
    t = sent.timings
    t.first_step, t.last_layer, t.kv_sent, t.kv_final = 1.0, 2.0, 2.4, 2.5
    sent.finish(FinishReason.ABORT, "the decode died")
    assert _timeline(sent, Role.PREFILL) is None
    sent.finish(FinishReason.HANDED_OFF)
    assert _timeline(sent, Role.PREFILL) == {"last_layer": 2.0, "sent": 2.4, "sampled": 2.5}
    received = Request("r", [1, 2, 3])
    t = received.timings
    t.last_layer, t.kv_landed, t.kv_end, t.first_step = 2.0, 2.6, 2.7, 2.8
    received.finish(FinishReason.LENGTH)
    assert _timeline(received, Role.DECODE) == {"last_layer": 2.0, "landed": 2.6,
                                                "learned": 2.7, "first_step": 2.8}
    received.timings.last_layer = None  # the prefill's clock is another host's
    assert _timeline(received, Role.DECODE) is None


def test_a_workers_kvmove_threads_are_not_pinned_to_its_model_cores(
        servers: ServerPool) -> None:
    """Each worker's model thread has its share of the cores (``--cpus``); its kvmove agent's
    threads (progress; the post and copy threads a hand-off started), ZeroMQ's, may run on every
    CPU (``kvmove.runtime.unpinned``)."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("one CPU: the workers are not pinned")
    server = servers.get("disagg")
    server.client().completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=2, **GREEDY)
    for name in ("prefill-0", "decode-0"):
        pid = server.worker(name)["pid"]
        threads = cpus_of_threads(pid)
        model_cpus = threads[pid]  # the main thread steps the model
        assert 0 < len(model_cpus) < len(every), (name, threads)
        wide = [tid for tid, cpus in threads.items() if cpus == every]
        # a progress thread, ZeroMQ's I/O and reaper threads; a prefill's post and copy threads
        assert len(wide) >= 3, (name, threads)


METRIC_TYPES = {  # name: type, for what the router measures and what the workers report
    "kvmove_requests": "counter", "kvmove_generated_tokens": "counter",
    "kvmove_kv_bytes": "counter", "kvmove_worker_restarts": "counter",
    "kvmove_ttft_seconds": "histogram", "kvmove_itl_seconds": "histogram",
    "kvmove_kv_transfer_seconds": "histogram", "kvmove_kv_exposed_seconds": "histogram",
    "kvmove_kv_handoff_ttft_ratio": "histogram", "kvmove_kv_handoff_seconds": "histogram",
    "kvmove_kv_handoff_stage_seconds": "histogram",
    "kvmove_pool_queue_length": "gauge", "kvmove_worker_free_blocks": "gauge",
    "kvmove_http_pending_requests": "gauge", "kvmove_http_rejected_requests": "counter",
    "kvmove_control_messages_dropped": "counter",
    "kvmove_agent_leases_active": "gauge", "kvmove_agent_blocks_quarantined": "gauge",
    "kvmove_agent_leases_expired": "counter", "kvmove_agent_checksum_mismatches": "counter",
    "kvmove_agent_leases_quarantined": "counter",
    "kvmove_agent_notifications_dropped": "counter",
    "kvmove_store_blocks": "gauge", "kvmove_store_capacity_blocks": "gauge",
    "kvmove_store_hits": "counter", "kvmove_store_served_blocks": "counter",
    "kvmove_store_read_bytes": "counter", "kvmove_store_read_seconds": "counter",
    "kvmove_store_decisions": "counter",
}


def test_metrics_follow_prometheus_conventions(servers: ServerPool) -> None:
    """``/metrics`` through prometheus_client's parser: each family's type; counters are
    ``_total`` (the workers' agent and store counters too, no longer gauges); base units
    (no GB/s or per-second gauges: PromQL divides bytes by seconds); a share is a
    ``_ratio``."""
    from prometheus_client.parser import text_string_to_metric_families

    server = servers.get("disagg-store")
    server.client().completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=4, **GREEDY)

    def families() -> dict:
        text = server.get("/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def granted() -> float:  # the decode's counter, as its last stats event (0.1 s) said
        samples = families().get("kvmove_agent_leases_granted")
        return max((s.value for s in samples.samples if s.labels.get("worker") == "decode-0"
                    and s.name.endswith("_total")), default=0.0) if samples else 0.0

    wait_until(lambda: {"kvmove_agent_leases_active", "kvmove_store_blocks"} <= set(families())
               and granted() >= 1, 5.0, "the workers' agent and store families, this lease")
    found = families()
    assert {name: found[name].type for name in METRIC_TYPES if name in found} == METRIC_TYPES
    for name, family in found.items():
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {f"{name}_total", f"{name}_created"}
        assert not any(word in name for word in ("gbps", "per_second", "share")), name
    assert {s.labels["worker"] for s in found["kvmove_store_read_bytes"].samples} == {
        "prefill-0"}  # a decode worker never prefills: no store
    assert {s.labels["worker"] for s in found["kvmove_agent_leases_granted"].samples} == {
        "prefill-0", "decode-0"}
    decode = {s.name: s.value for s in found["kvmove_agent_leases_granted"].samples
              if s.labels["worker"] == "decode-0"}
    assert decode["kvmove_agent_leases_granted_total"] >= 1  # this test's request


def _store_sample(server: Server, name: str, tier: str) -> float:
    return server.samples().get((name, (("tier", tier), ("worker", "prefill-0"))), 0.0)


def test_a_restarted_server_loads_a_repeated_prompt_from_its_disk_store(
        tmp_path: Path, reference: dict[str, list[int]]) -> None:
    """``--store-dir``: the prefill worker offers a prompt's blocks to its disk tier; a new
    server on the same directory (an empty live cache) loads them instead of prefilling, and
    the text is the same."""
    prompt = PROMPTS[-1]
    usable = (num_tokens(prompt) - 1) // BLOCK  # the last token is always computed
    args = ("--mode", "disagg", "--chunk-size", str(CHUNK), "--store-dir", str(tmp_path))
    served = "kvmove_store_served_blocks_total"
    texts = []
    for run in range(2):
        server = Server(*args)
        try:
            result = server.client().completions.create(model=MODEL, prompt=prompt,
                                                        max_tokens=MAX_TOKENS, **GREEDY)
            texts.append(result.choices[0].text)
            # s=server binds this run's server to the predicate (wait_until calls it at once).
            wait_until(lambda s=server: _store_sample(s, "kvmove_store_blocks", "disk") >= usable,
                       5.0, "prefill-0's disk tier holds the prompt's blocks")
            if run == 1:
                wait_until(lambda s=server: _store_sample(s, served, "disk") > 0,
                           5.0, "prefill-0 loaded blocks from its disk tier")
                assert _store_sample(server, served, "disk") == usable
                assert _store_sample(server, "kvmove_store_corrupt_blocks_total", "disk") == 0
        finally:
            server.close()
    assert texts == [text_of(reference[prompt])] * 2


# --- a port in use, bad options -----------------------------------------------------------------

def _serve_command() -> list[str]:
    """The installed ``kvmove-serve`` script when there is one, else ``python -m``."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    script = shutil.which("kvmove-serve", path=search)
    return [script] if script else [sys.executable, "-m", "kvmove.serve.cli"]


def test_a_port_in_use_exits_1_and_leaves_no_worker(servers: ServerPool) -> None:
    port = str(urlparse(servers.get("colocated").url).port)
    tag = uuid.uuid4().hex
    result = subprocess.run(
        [*_serve_command(), "--mode", "colocated", "--workers", "1", "--port", port],
        capture_output=True, text=True, cwd=WORKDIR, timeout=START_SECONDS,
        env={**os.environ, TAG_VARIABLE: tag})
    try:
        wait_until(lambda: not tagged_pids(tag), GONE_SECONDS, "no worker of it left")
    finally:
        for pid in tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
    assert "ready" not in result.stdout
    assert port in result.stderr, result.stderr
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


BAD_OPTIONS = {  # id: (arguments, words the message must hold)
    "mode": (["--mode", "both"], ["mode", "both"]),
    "workers-0": (["--workers", "0"], ["workers", "0"]),
    "workers-not-int": (["--workers", "two"], ["workers", "two"]),
    "decode-negative": (["--mode", "disagg", "--decode", "-1"], ["decode", "-1"]),
    "chunk-size-0": (["--chunk-size", "0"], ["chunk", "0"]),
    "port": (["--port", "70000"], ["port", "70000"]),
    "request-timeout": (["--request-timeout", "-1"], ["timeout", "-1"]),
    "model": (["--model", "/nonexistent/model"], ["model", "/nonexistent/model",
                                                 "no such directory"]),
    "model-no-config": (["--model", "/tmp"], ["--model", "'/tmp'", "no config.json"]),
    "worker-bounds": (["--planner", "--mode", "disagg", "--prefill-workers", "3:1"],
                      ["--prefill-workers", "MIN <= MAX", "3:1"]),
    "key-file": (["--key-file", "/nonexistent/key"], ["--key-file", "/nonexistent/key"]),
    "store-disk-gb-alone": (["--store-disk-gb", "5"], ["--store-disk-gb", "--store-dir"]),
    "transports": (["--transports", "foo"], ["--transports", "foo"]),
}


@pytest.mark.parametrize(("args", "words"), BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_a_bad_option_exits_2_naming_it(args: list[str], words: list[str]) -> None:
    tag = uuid.uuid4().hex
    result = subprocess.run([*_serve_command(), "--port", "0", *args], capture_output=True,
                            text=True, cwd=WORKDIR, timeout=START_SECONDS,
                            env={**os.environ, TAG_VARIABLE: tag})
    assert result.returncode == 2, result.stderr
    assert not tagged_pids(tag)
    # kvmove-serve's (or argparse's) error line; UCX may print its own diagnostics after it
    message = [line for line in result.stderr.splitlines() if "kvmove-serve: error:" in line][-1]
    for word in words:
        assert word in message, message
    assert "Traceback" not in result.stderr and "ready" not in result.stdout


def test_version_prints_kvmoves_version() -> None:
    import kvmove

    result = subprocess.run([*_serve_command(), "--version"], capture_output=True, text=True,
                            cwd=WORKDIR, timeout=START_SECONDS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvmove-serve {kvmove.__version__}"


def test_log_level_is_the_option_else_kvmove_log_level_else_info(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmove.serve.cli import log_level

    monkeypatch.delenv("KVMOVE_LOG_LEVEL", raising=False)
    assert log_level(None) == "info"
    monkeypatch.setenv("KVMOVE_LOG_LEVEL", "WARNING")
    assert log_level(None) == "warning"
    assert log_level("debug") == "debug"


def test_a_bad_kvmove_log_level_refuses_to_start_naming_it() -> None:
    """(``import kvmove`` itself refuses it, with a traceback: ``kvmove/_log.py``.)"""
    result = subprocess.run([*_serve_command(), "--port", "0"], capture_output=True,
                            text=True, cwd=WORKDIR, timeout=START_SECONDS,
                            env={**os.environ, "KVMOVE_LOG_LEVEL": "loud"})
    assert result.returncode != 0 and "loud" in result.stderr, result.stderr
    assert "ready" not in result.stdout


def test_the_default_log_shows_workers_by_name_and_uvicorns_access_lines(
        servers: ServerPool) -> None:
    """At the default level (info) the server's log holds each worker's lines under its name,
    and uvicorn's access lines (its level follows the server's: it was fixed at warning)."""
    server = servers.get("colocated")
    _assert_served(server)
    wait_until(lambda: '"POST /v1/completions HTTP/1.1" 200' in server.stderr_text(None),
               5.0, "an access line")
    log = server.stderr_text(None)
    for name in ("worker-0", "worker-1"):
        assert f"INFO kvmove.serve.worker: [{name}] kvmove.serve.worker_main: ready" in log
    assert "command add" not in log  # a worker's debug line, not shown at info


# --- failures: these damage or stop their server, so they come last ---------------------------

def _read(stream: openai.Stream, n: int) -> Iterator:
    chunks = iter(stream)
    for _ in range(n):
        assert next(chunks).choices[0].finish_reason is None
    return chunks


def _until_error(chunks: Iterator) -> tuple[openai.APIError, float]:
    """Reads on until the stream fails; the error and the seconds it took."""
    start = time.monotonic()
    with pytest.raises(openai.APIError) as error:
        for _ in chunks:
            pass
    return error.value, time.monotonic() - start


def test_a_decode_worker_killed_mid_stream_ends_the_stream_with_an_error(
        own: Callable[[str], Server]) -> None:
    server = own("disagg")
    decode = server.worker("decode-0")
    chunks = _read(server.client(timeout=ERROR_SECONDS * 2).completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=LONG_TOKENS, stream=True, **GREEDY), 3)
    os.kill(decode["pid"], signal.SIGKILL)
    error, seconds = _until_error(chunks)
    # the error event, not a read timeout or a dropped connection (APIError's subclasses)
    assert type(error) is openai.APIError, repr(error)
    assert "decode-0" in str(error) and seconds < ERROR_SECONDS, (str(error), seconds)
    wait_until(lambda: not server.worker("decode-0")["alive"], ERROR_SECONDS,
               "/health reports decode-0 dead")
    response = server.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "down"
    assert server.worker("prefill-0")["alive"]
    with pytest.raises(openai.APIStatusError) as refused:  # no decode worker: refused at once
        server.client(timeout=ERROR_SECONDS).completions.create(model=MODEL, prompt="hi",
                                                                max_tokens=2)
    assert refused.value.status_code >= 500 and "decode" in str(refused.value)


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_a_killed_worker_is_started_again_and_readmitted(
        own: Callable[[str], Server], reference: dict[str, list[int]], victim: str) -> None:
    """kvmove-serve's default: a worker SIGKILLed is started again under its name and
    re-admitted once it is every survivor's kvmove peer again (the survivor, holding the dead
    worker's metadata, takes the new incarnation's without restarting: NIXL #1986's scenario).
    A decode worker's stream in flight ends with an error event (a prefill worker holds a
    request only until its KV is handed off); the next requests get exactly the colocated
    greedy text."""
    server = own("disagg-restart")
    client = server.client()
    prompt = PROMPTS[3]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    assert first.choices[0].text == text_of(reference[prompt][:8])
    old_pid = server.worker(victim)["pid"]
    if victim.startswith("decode"):
        chunks = _read(server.client(timeout=ERROR_SECONDS * 2).completions.create(
            model=MODEL, prompt=PROMPTS[5], max_tokens=LONG_TOKENS, stream=True, **GREEDY), 3)
        os.kill(old_pid, signal.SIGKILL)
        error, seconds = _until_error(chunks)
        assert type(error) is openai.APIError, repr(error)
        assert victim in str(error) and seconds < ERROR_SECONDS, (str(error), seconds)
    else:
        os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: (server.worker(victim)["pid"] != old_pid and
                        server.worker(victim)["alive"] and server.worker(victim)["ready"]),
               60.0, f"{victim} started again and ready")
    assert server.health()["status"] == "ok"
    for prompt in PROMPTS[:4]:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
        assert result.choices[0].text == text_of(reference[prompt][:8])
    metrics = server.get("/metrics").text
    assert f'kvmove_worker_restarts_total{{worker="{victim}"}} 1.0' in metrics, metrics
    assert not process_alive(old_pid)


def test_a_colocated_worker_killed_mid_stream_the_other_serves_on(
        own: Callable[[str], Server], reference: dict[str, list[int]]) -> None:
    server = own("colocated")
    chunks = _read(server.client(timeout=ERROR_SECONDS * 2).completions.create(
        model=MODEL, prompt=PROMPTS[5], max_tokens=LONG_TOKENS, stream=True, **GREEDY), 3)
    wait_until(lambda: any(w.get("running") for w in server.health()["workers"]), 5.0,
               "a worker reports the stream running")
    victim, survivor = sorted(server.health()["workers"], key=lambda w: -w.get("running", 0))
    os.kill(victim["pid"], signal.SIGKILL)
    error, seconds = _until_error(chunks)
    assert type(error) is openai.APIError, repr(error)
    assert victim["name"] in str(error) and seconds < ERROR_SECONDS, (str(error), seconds)
    wait_until(lambda: server.health()["status"] == "degraded", ERROR_SECONDS,
               "/health reports the server degraded")
    assert server.get("/health").status_code == 200
    assert not server.worker(victim["name"])["alive"] and server.worker(survivor["name"])["alive"]
    client = server.client()
    for prompt in PROMPTS[:4]:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
        assert result.choices[0].text == text_of(reference[prompt][:8])
    assert process_alive(survivor["pid"]) and not process_alive(victim["pid"])


def test_a_client_that_goes_away_frees_its_worker(own: Callable[[str], Server]) -> None:
    """The stream's client disconnects after 3 of 4,000 tokens: within seconds the decode
    worker has dropped the request (its batch empty, its blocks back), where generating the
    rest would take it far longer (tens of seconds)."""
    server = own("disagg")
    stream = server.client().completions.create(model=MODEL, prompt="Hello",
                                                max_tokens=FULL_CONTEXT_TOKENS, stream=True,
                                                **GREEDY)
    _read(stream, 3)
    wait_until(lambda: server.worker("decode-0")["running"] == 1, 5.0,
               "decode-0 reports the stream running")  # its report, not an older one
    stream.close()

    def idle() -> bool:
        w = server.worker("decode-0")
        return w["running"] == 0 and w["waiting"] == 0 and w["free_blocks"] == NUM_BLOCKS

    wait_until(idle, 3.0, lambda: f"decode-0 idle once its client left: "
                                  f"{server.worker('decode-0')}")


@pytest.mark.parametrize(("sig", "name"), [(signal.SIGINT, "chunked"),
                                           (signal.SIGTERM, "single")], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_and_every_worker(own: Callable[[str], Server], sig: int,
                                                    name: str) -> None:
    server = own(name)
    assert server.worker_pids and all(process_alive(p) for p in server.worker_pids)
    code = server.stop(sig, SHUTDOWN_SECONDS)
    server.wait_gone()
    assert code == 0, f"exit code {code} after {signal.Signals(sig).name}\n{server.stderr_text()}"
    assert "Traceback" not in server.stderr_text()


def test_sigterm_with_streams_in_flight_stops_within_a_deadline(
        own: Callable[[str], Server]) -> None:
    """Streams still running must not hold the shutdown (4 of 4,000 tokens would take minutes
    to finish): the server exits within the deadline, each stream ends (an error, or its
    end), none hangs."""
    server = own("single")
    client = server.client()
    streams = [_read(client.completions.create(model=MODEL, prompt="Hello",
                                               max_tokens=FULL_CONTEXT_TOKENS, stream=True,
                                               **GREEDY), 1) for _ in range(4)]
    ended = [threading.Event() for _ in streams]

    def drain(chunks: Iterator, done: threading.Event) -> None:
        try:
            for _ in chunks:
                pass
        except Exception:  # noqa: BLE001 - an error event or a closed connection: it ended
            pass
        finally:
            done.set()

    for chunks, done in zip(streams, ended):
        threading.Thread(target=drain, args=(chunks, done), daemon=True).start()
    code = server.stop(signal.SIGTERM, SHUTDOWN_SECONDS)
    assert all(done.wait(GONE_SECONDS) for done in ended), "a stream open after the server quit"
    server.wait_gone()
    assert code is not None, f"still running {SHUTDOWN_SECONDS:g} s after SIGTERM"
    assert code == 0, f"exit code {code}\n{server.stderr_text()}"
