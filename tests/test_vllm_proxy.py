"""``kvmove-serve --vllm-prefill ... --vllm-decode ...`` (``kvmove/serve/vllm/proxy.py``) as a
real process in front of stand-in vLLM servers (``helpers/fake_vllm.py``), through the official
OpenAI client: the P/D protocol each mode speaks, streaming, failures and metrics. No vLLM
needed; the connector's end-to-end test runs real vLLM behind this proxy.
"""

from __future__ import annotations

import signal
import socket

import httpx
import openai
import pytest

from kvmove.errors import ConfigError
from kvmove.serve.cli import main
from kvmove.serve.vllm.pools import Pool, ProxyConfig

from helpers.fake_vllm import FakeFleet, FakeVLLM
from helpers.serve import HTTP_SECONDS, Server, wait_until

PROMPT = "The capital of France is"
# What vLLM's toy proxy sends a prefill instance: the protocol, written out (not imported)
PULL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def fleet():
    with FakeFleet(FakeVLLM("p0"), FakeVLLM("p1"), FakeVLLM("d0"), FakeVLLM("d1")) as fleet:
        yield fleet


def _proxy(fleet: FakeFleet, prefill: str, decode: str, *args: str) -> Server:
    urls = fleet.servers
    return Server("--vllm-prefill", urls[prefill].url, "--vllm-decode", urls[decode].url,
                  *args, engine=False)


@pytest.fixture(scope="module")
def pull(fleet):
    server = _proxy(fleet, "p0", "d0", "--kv-mode", "pull")
    yield server
    server.close()


@pytest.fixture(scope="module")
def push(fleet):
    server = _proxy(fleet, "p1", "d1")
    yield server
    server.close()


def _prefill_checks(body: dict, chat: bool) -> None:
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body
    if chat:
        assert body["max_completion_tokens"] == 1


def test_pull_sends_prefill_then_forwards_its_params(fleet, pull):
    fleet.clear()
    out = pull.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                           temperature=0)
    assert out.choices[0].text == "Hello from a fake vLLM"
    p, d = fleet.requests()
    assert (p.server, d.server) == ("p0", "d0")
    assert p.request_id and p.request_id == d.request_id
    sent = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    assert p.body == {**sent, "max_tokens": 1, "stream": False,
                      "kv_transfer_params": PULL_PARAMS}
    assert d.body == {**sent, "kv_transfer_params": fleet.servers["p0"].kv_params()}


def test_pull_chat_streams_through(fleet, pull):
    fleet.clear()
    stream = pull.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Request-Id": "req-42"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello from a fake vLLM"
    p, d = fleet.requests()
    assert p.request_id == d.request_id == "req-42"
    _prefill_checks(p.body, chat=True)
    assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}
    assert d.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"


def test_push_falls_back_to_pull_then_sends_decode_first(fleet, push):
    client = push.client()
    fleet.clear()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    p, d = fleet.requests()  # the first: p1's kvmove address is not known yet
    assert (p.server, d.server) == ("p1", "d1")
    assert p.body["kv_transfer_params"] == PULL_PARAMS
    for stream in (False, True):
        fleet.clear()
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                        stream=stream)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == "Hello from a"
        d, p = fleet.requests()  # the decode's request arrived first
        assert (d.server, p.server) == ("d1", "p1") and d.request_id == p.request_id
        _prefill_checks(p.body, chat=False)
        tid = d.body["kv_transfer_params"]["kvmove_transfer_id"]
        assert len(tid) == 32
        # its address, and its TP (a decode of another TP needs it to pick its sources)
        address = {k: fleet.servers["p1"].kv_params()[k]
                   for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
        assert d.body["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "kvmove_transfer_id": tid, **address}
        assert p.body["kv_transfer_params"] == {
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "push",
            "kvmove_transfer_id": tid}
    handoffs = {dict(k[1])["mode"]: v for k, v in push.samples().items()
                if k[0] == "kvmove_proxy_handoffs_total"}
    assert handoffs["push"] >= 2 and handoffs["pull"] == 0
    assert handoffs["pull-fallback"] == 1


def test_push_prefill_failure_leaves_the_decode_alone(fleet, push):
    client = push.client()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)  # p1's address known
    out = client.completions.create(model="tiny", prompt="fail-push", max_tokens=2)
    assert out.choices[0].text == "Hello from"
    key = ("kvmove_proxy_errors_total",
           (("instance", fleet.servers["p1"].url), ("kind", "status"), ("pool", "prefill")))
    wait_until(lambda: push.samples().get(key) == 1, HTTP_SECONDS,
               "the push prefill's 500 counted")


def test_upstream_down_and_timeout(fleet):
    dead = f"http://127.0.0.1:{_closed_port()}"
    server = Server("--vllm-prefill", fleet.servers["p0"].url, "--vllm-decode", dead,
                    "--kv-mode", "pull", "--request-timeout", "1", engine=False)
    try:
        client = server.client()
        with pytest.raises(openai.APIStatusError) as down:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert down.value.status_code == 502 and dead in down.value.message
        with pytest.raises(openai.APIStatusError) as slow:
            client.completions.create(model="tiny", prompt="hang", max_tokens=2)
        assert slow.value.status_code == 504 and fleet.servers["p0"].url in slow.value.message
        health = server.get("/health")
        assert health.status_code == 503 and list(health.json()["failing"]) == [dead]
    finally:
        server.close()


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'"text"'])
def test_bad_body_is_400(pull, raw):
    response = pull.post("/v1/completions", content=raw,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_closes_the_upstream_stream(fleet, pull):
    d0 = fleet.servers["d0"]
    with httpx.stream("POST", f"{pull.url}/v1/completions", timeout=HTTP_SECONDS,
                      json={"model": "tiny", "prompt": "slow", "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until(lambda: d0.cut == [True], HTTP_SECONDS, "the decode's stream cut")
    key = ("kvmove_proxy_requests_in_flight", (("instance", d0.url), ("pool", "decode")))
    wait_until(lambda: pull.samples()[key] == 0, HTTP_SECONDS, "nothing in flight")


def test_models_health_and_metrics(fleet, pull):
    assert pull.client().models.list().data[0].owned_by == "d0"
    assert pull.get("/health").status_code == 200
    samples = pull.samples()
    p0 = (("instance", fleet.servers["p0"].url), ("pool", "prefill"))
    assert samples[("kvmove_proxy_requests_total", p0)] >= 2
    assert samples[("kvmove_proxy_upstream_ttfb_seconds_count", p0)] >= 2
    assert samples[("kvmove_proxy_requests_in_flight", p0)] == 0
    handoffs = {dict(k[1])["mode"]: v for k, v in samples.items()
                if k[0] == "kvmove_proxy_handoffs_total"}
    assert handoffs["pull"] >= 3 and handoffs["push"] == 0
    assert samples[("kvmove_proxy_http_rejected_requests_total", (("status", "400"),))] >= 1


@pytest.mark.parametrize("args, message", [
    (["--vllm-prefill", "http://a:1"], "go together"),
    (["--vllm-prefill", "http://a:1", "--vllm-decode", "http://b:1", "--model", "tiny"],
     "--model"),
    (["--vllm-prefill", "http://a:1", "--vllm-decode", "http://b:1", "--mode=colocated",
      "--decode", "1"], "--mode, --decode"),
    (["--kv-mode", "pull"], "--kv-mode needs"),
])
def test_misuse_exits_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_repeated_pool_flags_add_up_and_routing_passes_through():
    """``--vllm-prefill A --vllm-prefill B`` is both instances (argparse's store would keep B
    alone, silently halving the pool)."""
    from kvmove.serve import cli

    argv = ["--vllm-prefill", "http://a:1", "--vllm-prefill", "http://b:1", "http://c:1",
            "--vllm-decode", "http://d:1", "--routing", "least-loaded"]
    parser = cli._parser()
    config = cli._proxy_config(parser, parser.parse_args(argv), argv)
    assert config is not None
    assert config.prefill == ("http://a:1", "http://b:1", "http://c:1")
    assert config.decode == ("http://d:1",) and config.routing == "least-loaded"


def test_bad_url_exits_2(capsys):
    assert main(["--vllm-prefill", "a:1", "--vllm-decode", "http://b:1"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


def test_prefill_refusal_passes_through(fleet, pull):
    fleet.clear()
    with pytest.raises(openai.BadRequestError) as refused:
        pull.client().completions.create(model="tiny", prompt="refuse", max_tokens=2)
    assert "prompt too long" in refused.value.message
    assert [r.server for r in fleet.requests()] == ["p0"]


def test_sigterm_with_a_stream_in_flight_exits_cleanly(push):  # last: it stops the proxy
    with httpx.stream("POST", f"{push.url}/v1/completions", timeout=HTTP_SECONDS,
                      json={"model": "tiny", "prompt": "slow", "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert push.stop(signal.SIGTERM) == 0  # within STOP_SECONDS
        try:  # it ended: finished, or cut at the graceful shutdown's end (5 s)
            for _ in lines:
                pass
        except httpx.HTTPError:
            pass
    push.wait_gone()


def test_pool_picks_least_in_flight_then_in_turn():
    pool = Pool.of("decode", ("http://a:1", "http://b:1", "http://c:1"))
    assert [pool.pick().url for _ in range(4)] == [
        "http://a:1", "http://b:1", "http://c:1", "http://a:1"]
    pool.instances[0].in_flight = 2
    pool.instances[2].in_flight = 1
    assert [pool.pick().url for _ in range(2)] == ["http://b:1", "http://b:1"]


@pytest.mark.parametrize("kwargs, message", [
    ({"prefill": ()}, "--vllm-prefill needs at least one URL"),
    ({"decode": ("http://d:1/",)}, "trailing slash"),
    ({"decode": ("http://d:1", "http://d:1")}, "names an instance twice"),
    ({"kv_mode": "both"}, "--kv-mode must be one of push, pull"),
    ({"request_timeout": 0.0}, "--request-timeout must be positive"),
])
def test_config_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ProxyConfig(**{"prefill": ("http://p:1",), "decode": ("http://d:1",), **kwargs})
