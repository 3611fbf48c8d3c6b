"""The serving benchmark (``kvmove/bench/serve.py`` and its ``serve_*.py`` parts).

Without a server: the trace (seeded, the same for every mode, Poisson arrivals, the mix), every
config rejection, the statistics on hand-made requests against numpy, the ``/metrics`` parser,
and the text and plots of a hand-made report. With ``kvmove-serve``: a server that cannot start
ends the run with its error, and a small run of the tiny model in two modes completes every
request with exactly ``max_tokens`` tokens and leaves no process behind. Numbers are never
asserted (benchmarks are tools, not tests).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
from dataclasses import replace

import numpy as np
import pytest

from kvmove.bench import serve, serve_load
from kvmove.bench.report import BenchError
from kvmove.bench.serve_config import ServeBenchConfig
from kvmove.bench.serve_load import parse_metrics
from kvmove.bench.serve_report import (
    ModeResult,
    QueueSample,
    RequestResult,
    ServeReport,
    format_serve,
    percentile,
    plot_serve,
)
from kvmove.bench.serve_server import ServerProcess, serve_arguments
from kvmove.bench.serve_trace import make_trace
from kvmove.errors import ConfigError

# --- the trace ------------------------------------------------------------------------------


def test_trace_is_seeded_and_the_same_for_every_mode() -> None:
    config = ServeBenchConfig(num_requests=50, seed=7)
    assert make_trace(config) == make_trace(ServeBenchConfig(num_requests=50, seed=7))
    assert make_trace(config) == make_trace(ServeBenchConfig(num_requests=50, seed=7,
                                                             modes=("disagg",), workers=4))
    assert make_trace(config) != make_trace(ServeBenchConfig(num_requests=50, seed=8))


def test_arrivals_are_poisson_at_the_rate() -> None:
    trace = make_trace(ServeBenchConfig(num_requests=4000, rate=5.0))
    gaps = np.diff([t.arrival for t in trace])
    assert trace[0].arrival == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_mix_has_the_asked_proportion_and_lengths(fraction: float) -> None:
    config = ServeBenchConfig(num_requests=40, long_fraction=fraction, long_prompt_bytes=300,
                              long_output_tokens=5, short_prompt_bytes=20, short_output_tokens=50)
    trace = make_trace(config)
    assert sum(t.kind == "long" for t in trace) == round(40 * fraction)
    for t in trace:
        expected = (300, 5) if t.kind == "long" else (20, 50)
        assert (len(t.prompt.encode()), t.max_tokens) == expected
        assert t.prompt.isascii()
    assert [t.index for t in trace] == list(range(40))


def test_prompts_share_no_first_block() -> None:
    """Prefix reuse must not skip a prefill: the first 16 bytes differ between requests."""
    trace = make_trace(ServeBenchConfig(num_requests=200))
    assert len({t.prompt[:16] for t in trace}) == 200


def test_shared_prefixes_keep_the_trace_and_mark_repeats() -> None:
    """Issue 19: every prompt is one of N prefixes then its own prompt; arrivals, kinds and own
    prompts are those of the trace without them; the first request of a prefix is no repeat."""
    plain = make_trace(ServeBenchConfig(num_requests=30))
    shared = make_trace(ServeBenchConfig(num_requests=30, shared_prefixes=3, prefix_bytes=100))
    assert [(t.arrival, t.kind) for t in shared] == [(t.arrival, t.kind) for t in plain]
    assert [t.prompt[100:] for t in shared] == [t.prompt for t in plain]
    assert len({t.prompt[:100] for t in shared}) == 3 == len({t.prefix for t in shared})
    seen: set[int] = set()
    for t in shared:
        assert t.repeat == (t.prefix in seen)
        assert t.prompt[:100] == shared[[u.prefix for u in shared].index(t.prefix)].prompt[:100]
        seen.add(t.prefix)
    assert sum(not t.repeat for t in shared) == 3
    assert all(t.prefix is None and not t.repeat for t in plain)


# --- config rejections ----------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"modes": ()}, "modes must be a non-empty tuple"),
    ({"modes": ("colocated", "pipelined")}, "unknown mode 'pipelined'"),
    ({"modes": ("chunked", "chunked")}, "must not repeat a mode"),
    ({"workers": 0}, "workers must be positive, got 0"),
    ({"workers": True}, "workers must be an int, got True"),
    ({"workers": 1}, "workers = 1 gives 0 prefill + 1 decode"),
    ({"prefill": 0}, "prefill must be positive, got 0"),
    ({"decode": 2.5}, "decode must be an int, got 2.5"),
    ({"chunk_size": -16}, "chunk_size must be positive, got -16"),
    ({"num_requests": 0}, "num_requests must be positive, got 0"),
    ({"short_output_tokens": 0}, "short_output_tokens must be positive, got 0"),
    ({"rate": 0}, "rate must be positive and finite, got 0"),
    ({"rate": math.inf}, "rate must be positive and finite, got inf"),
    ({"itl_slo": -0.1}, "itl_slo must be positive and finite, got -0.1"),
    ({"timeout": "60"}, "timeout must be a number, got '60'"),
    ({"long_fraction": 1.5}, "long_fraction must be in [0, 1], got 1.5"),
    ({"seed": "0"}, "seed must be an int, got '0'"),
    ({"url": "http://127.0.0.1:8000"}, "with url, modes must name the server's one mode"),
    ({"url": "127.0.0.1:8000", "modes": ("disagg",)},
     "url must be http://HOST:PORT, got '127.0.0.1:8000'"),
    ({"url": "http://127.0.0.1:8000/v1", "modes": ("disagg",)},
     "url must be http://HOST:PORT, got 'http://127.0.0.1:8000/v1'"),
    ({"model": "tiny", "long_prompt_bytes": 4000, "long_output_tokens": 100},
     "a long request needs 4000 + 1 (BOS) + 100 positions, tiny has 4096"),
    ({"model": "tiny", "long_prompt_bytes": 3000, "shared_prefixes": 2,
      "prefix_bytes": 1090}, "a long request needs 4090 + 1 (BOS) + 16 positions"),
    ({"routings": ("kv", "kv")}, "routings must be distinct values of"),
    ({"routings": ("random",)}, "routings must be distinct values of"),
    ({"shared_prefixes": -1}, "shared_prefixes must be an int >= 0, got -1"),
    ({"prefix_bytes": 0}, "prefix_bytes must be positive, got 0"),
    ({"planners": ("on", "on")}, "planners must be distinct values of"),
    ({"planners": ("sometimes",)}, "planners must be distinct values of"),
    ({"planners": ("on",), "prefill_workers": "2:1"},
     "worker bounds must be 1 <= MIN <= MAX, got 2:1"),
    ({"planners": ("on",), "decode_workers": "two"}, "worker bounds must be MIN:MAX, got 'two'"),
    ({"prefill_workers": "1:2"}, "prefill_workers bounds the planner: give planners 'on' too"),
])
def test_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ServeBenchConfig(**kwargs)


def test_config_accepts_overrides_and_lists() -> None:
    config = ServeBenchConfig(modes=["disagg"], workers=2, prefill=1, decode=3)
    assert config.modes == ("disagg",)
    assert config.instances("disagg") == {"prefill": 1, "decode": 3}
    assert ServeBenchConfig(workers=3).instances("disagg") == {"prefill": 1, "decode": 2}
    assert ServeBenchConfig(workers=3).instances("chunked") == {"workers": 3}
    assert ServeBenchConfig(modes=("colocated",), workers=1).instances("colocated") == {
        "workers": 1}


def test_the_planner_runs_disagg_once_more_and_only_disagg() -> None:
    config = ServeBenchConfig(modes=("colocated", "disagg"), planners=["off", "on"],
                              num_requests=4, prefill_workers="1:2")
    assert serve._runs(config) == [("colocated", "kv", "off"), ("disagg", "kv", "off"),
                                   ("disagg", "kv", "on")]
    assert serve.count_steps(config) == 3 * (4 + 2)


# --- statistics -----------------------------------------------------------------------------


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))


def _request(index: int, times: tuple[float, ...], sent: float = 0.0, max_tokens: int = 0,
             error: str | None = None) -> RequestResult:
    return RequestResult(index, "short", max_tokens or len(times), sent, times,
                         (times[-1] if times else 0.0) + 0.001, error)


def test_request_ttft_itl_and_slos() -> None:
    r = _request(0, (0.5, 0.6, 0.8, 0.9))
    assert r.ttft == 0.5 and r.tokens == 4 and r.completed
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.meets(ttft_slo=0.5, itl_slo=0.14)
    assert not r.meets(ttft_slo=0.49, itl_slo=1.0)  # TTFT
    assert not r.meets(ttft_slo=1.0, itl_slo=0.13)  # mean ITL
    one = _request(1, (0.2,))
    assert one.tpot is None and one.meets(ttft_slo=0.3, itl_slo=1e-9)
    short = _request(2, (0.1, 0.2), max_tokens=3)
    assert not short.completed and not short.meets(1.0, 1.0)
    failed = _request(3, (0.1, 0.2), error="APIError: boom")
    assert not failed.completed and not failed.meets(1.0, 1.0)
    assert _request(4, ()).ttft is None and _request(4, ()).itls == []


def _mode(mode: str = "colocated", **kv: float) -> ModeResult:
    """Three requests sent at 0, 1 and 2 s; the third fails after two of its three tokens."""
    requests = (_request(0, (0.1, 0.2, 0.3), sent=0.0),
                _request(1, (1.0, 1.5, 2.0), sent=1.0),
                _request(2, (0.2, 0.25), sent=2.0, max_tokens=3))
    samples = (QueueSample(0.0, {"prefill": 0.0, "decode": 1.0}, {"decode": 1.0}),
               QueueSample(0.5, {"prefill": 2.0, "decode": 0.0}, {"decode": 2.0}))
    return ModeResult(mode, {"workers": 2}, requests, samples, **kv)


def test_mode_statistics() -> None:
    m = _mode()
    assert m.wall_seconds == pytest.approx(3.001)  # request 1 ends at 1 + 2.0 + 0.001
    assert m.ttfts == [0.1, 1.0, 0.2]
    assert m.ttft(50) == pytest.approx(0.2)
    assert sorted(m.itls) == pytest.approx([0.05, 0.1, 0.1, 0.5, 0.5])
    assert m.itl(50) == pytest.approx(0.1)
    assert m.itl_spread == pytest.approx(np.percentile(m.itls, 99) / 0.1)
    assert m.output_tokens == 8 and m.failures == 1
    assert m.tokens_per_s == pytest.approx(8 / 3.001)
    assert m.good(ttft_slo=0.5, itl_slo=0.2) == 1  # request 1: TTFT 1.0; request 2 failed
    assert m.goodput(ttft_slo=2.0, itl_slo=1.0) == pytest.approx(2 / 3.001)
    assert m.kv_share is None


def test_kv_share_is_mean_exposed_transfer_over_mean_ttft() -> None:
    m = _mode("disagg", kv_bytes=1e6, kv_transfer_seconds=0.9, kv_transfers=3,
              kv_exposed_seconds=0.3)
    assert m.kv_share == pytest.approx(0.1 / statistics.fmean([0.1, 1.0, 0.2]))


HANDOFF = dict(kv_bytes=1e6, kv_transfer_seconds=0.9, kv_transfers=3, kv_exposed_seconds=0.3,
               kv_handoff_seconds=0.06, kv_handoffs=3,
               kv_timeline={"sent": 0.001, "learned": 0.02, "first_step": 0.03})


def test_kv_share_is_the_measured_handoff_when_the_server_has_it() -> None:
    """Mean hand-off (last layer computed to the decode seeing the KV in) over mean TTFT,
    not the exposed transfer; the timeline in ms in the JSON."""
    m = _mode("disagg", **HANDOFF)
    assert m.kv_handoff == pytest.approx(0.02)
    assert m.kv_share == pytest.approx(0.02 / statistics.fmean([0.1, 1.0, 0.2]))
    assert m.to_dict(2.0, 0.1)["kv_timeline_ms"] == pytest.approx(
        {"sent": 1.0, "learned": 20.0, "first_step": 30.0})


def test_format_serve_shows_the_handoff_and_its_timeline() -> None:
    config = ServeBenchConfig(num_requests=3, model="tiny", rate=1.0)
    text = format_serve(ServeReport(config, make_trace(config), (_mode("disagg", **HANDOFF),),
                                    wall_seconds=1.0))
    lines = text.splitlines()
    disagg = next(line for line in lines if line.startswith("disagg") and "%" in line)
    assert disagg.endswith("4.62% (20.00 ms hand-off; 100.00 of 300.00 ms, 1.0 MB)")
    timeline = next(line for line in lines if "KV hand-off timeline" in line)
    assert timeline.startswith("disagg KV hand-off timeline (3 hand-offs, 0.33 MB each;")
    assert timeline.endswith("bytes all landed +1.00, decode saw the KV in +20.00, "
                             "decode's first step +30.00")


def test_stage_means_are_deltas_over_the_run() -> None:
    before = ({"sent": 1.0, "learned": 2.0}, {"sent": 10.0, "learned": 10.0})
    after = ({"sent": 1.5, "learned": 2.0, "landed": 0.2}, {"sent": 20.0, "learned": 10.0,
                                                           "landed": 4.0})
    assert serve_load.stage_means(before, after) == pytest.approx({"sent": 0.05,
                                                                    "landed": 0.05})


def test_parse_metrics() -> None:
    text = """# HELP kvmove_pool_queue_length Requests waiting per pool.
# TYPE kvmove_pool_queue_length gauge
kvmove_pool_queue_length{pool="prefill"} 3.0
kvmove_pool_queue_length{pool="decode"} 1.0
kvmove_pool_running{pool="decode",worker="d-0"} 2.0
kvmove_pool_running{pool="decode",worker="d-1"} 5.0
kvmove_kv_bytes_total 1.048576e+06
kvmove_kv_transfer_seconds_bucket{le="+Inf"} 4.0
kvmove_kv_transfer_seconds_sum 0.25
"""
    metrics = parse_metrics(text)
    assert serve_load.by_pool(metrics, "kvmove_pool_queue_length") == {"prefill": 3.0,
                                                                         "decode": 1.0}
    assert serve_load.by_pool(metrics, "kvmove_pool_running") == {"decode": 7.0}
    assert serve_load.metric_total(metrics, "kvmove_kv_bytes_total") == 1048576.0
    assert metrics["kvmove_kv_transfer_seconds_bucket"] == [({"le": "+Inf"}, 4.0)]
    assert serve_load.metric_total(metrics, "kvmove_kv_transfer_seconds_count") == 0.0



def test_parse_metrics_reads_what_prometheus_client_writes() -> None:
    """The server's real output (typed families, ``_total`` and ``_created`` samples,
    histogram buckets, escaped label values), through prometheus_client's own parser."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    Counter("kvmove_kv_bytes", "KV bytes.", registry=registry).inc(4096)
    Gauge("kvmove_pool_queue_length", "Queue.", ["pool"], registry=registry).labels(
        pool='de"code,1').set(2)
    hist = Histogram("kvmove_kv_transfer_seconds", "Transfer.", buckets=(0.1, 1.0),
                     registry=registry)
    hist.observe(0.05)
    hist.observe(0.5)
    metrics = parse_metrics(generate_latest(registry).decode())
    assert serve_load.metric_total(metrics, "kvmove_kv_bytes_total") == 4096.0
    assert serve_load.by_pool(metrics, "kvmove_pool_queue_length") == {'de"code,1': 2.0}
    assert serve_load.metric_total(metrics, "kvmove_kv_transfer_seconds_count") == 2.0
    assert serve_load.metric_total(metrics, "kvmove_kv_transfer_seconds_sum") == 0.55
    assert ({"le": "0.1"}, 1.0) in metrics["kvmove_kv_transfer_seconds_bucket"]

# --- the report -----------------------------------------------------------------------------


def _report() -> ServeReport:
    config = ServeBenchConfig(num_requests=3, model="tiny", rate=1.0)
    modes = (_mode("colocated"), _mode("chunked"),
             _mode("disagg", kv_bytes=2e6, kv_transfer_seconds=0.9, kv_transfers=3,
                   kv_exposed_seconds=0.3))
    return ServeReport(config, make_trace(config), modes, wall_seconds=12.5)


def test_format_serve() -> None:
    text = format_serve(_report())
    lines = text.splitlines()
    assert lines[0].startswith("model tiny, 3 requests (seed 0), Poisson arrivals at 1/s")
    head = next(line for line in lines if line.startswith("mode") and "TTFT p50 ms" in line)
    assert "ITL p99/p50" in head
    disagg = next(line for line in lines if line.startswith("disagg") and "%" in line)
    # 0.3 s exposed / 3 over the mean TTFT 0.433 s, of 0.9 s / 3 transfer
    assert disagg.endswith("23.08% (100.00 of 300.00 ms, 2.0 MB)")
    assert "against colocated (same trace, same run):" in lines
    assert any(line.startswith("  disagg: TTFT p99 1.00x") for line in lines)
    assert "  chunked request 2 (short): 2 of 3 tokens" in lines
    assert text.endswith("measured in 12.5 s")
    json.dumps(_report().to_dict())  # the --json form serialises


def test_format_serve_compares_routings_on_repeats_of_shared_prefixes() -> None:
    """Issue 19: with shared prefixes, a table of repeat and first TTFTs and the matched
    prefix per request, and the repeats' TTFT in the ratios; each routing labelled."""
    config = ServeBenchConfig(num_requests=3, model="tiny", rate=1.0, shared_prefixes=1,
                              routings=("kv", "least-loaded"))
    trace = make_trace(config)
    assert [t.repeat for t in trace] == [False, True, True]

    def mode(routing: str, repeat_ttft: float, matched: float) -> ModeResult:
        requests = tuple(RequestResult(i, "long", 1, 0.0, (0.4 if i == 0 else repeat_ttft,),
                                       1.0, None) for i in range(3))
        return ModeResult("colocated", {"workers": 2}, requests, (), routing=routing,
                          matched_tokens=matched, routed=3)

    report = ServeReport(config, trace, (mode("kv", 0.1, 1024.0), mode("least-loaded", 0.2,
                                                                         0.0)), 5.0)
    lines = format_serve(report).splitlines()
    assert "1 shared prefixes of 512 B:" in lines
    kv = next(line for line in lines if line.startswith("colocated kv ") and "341" in line)
    assert kv.split()[2:6] == ["2", "100.00", "100.00", "1"]
    assert "against colocated kv (same trace, same run):" in lines
    assert any(line.startswith("  colocated least-loaded: TTFT of repeats p50 2.00x, mean "
                               "2.00x, ") for line in lines)
    json.dumps(report.to_dict())


def test_format_serve_shows_the_planners_decisions_and_pool_sizes() -> None:
    """Issue 19: a run with the planner lists its decisions with their reasons, and each
    pool's workers at the first sample, at most and at the last."""
    config = ServeBenchConfig(modes=("disagg",), num_requests=1, model="tiny", planners=("on",))
    trace = make_trace(config)
    samples = (QueueSample(0.0, {}, {}, {"prefill": 1.0, "decode": 1.0}),
               QueueSample(1.0, {}, {}, {"prefill": 2.0, "decode": 1.0}),
               QueueSample(2.0, {}, {}, {"prefill": 1.0, "decode": 1.0}))
    result = ModeResult("disagg", {"prefill": 1, "decode": 1},
                        (RequestResult(0, "long", 1, 0.0, (0.4,), 1.0, None),), samples,
                        planner=True, planner_decisions={"prefill add queue": 1,
                                                         "prefill drain idle": 1})
    lines = format_serve(ServeReport(config, trace, (result,), 3.0)).splitlines()
    assert "disagg planner: planner decisions: prefill add queue x1, prefill drain idle x1" \
        in lines
    assert "  workers per pool (first / most / last sample): decode 1 / 1 / 1; " \
        "prefill 1 / 2 / 1" in lines
    data = ServeReport(config, trace, (result,), 3.0).to_dict()
    assert data["modes"][0]["planner_decisions"] == {"prefill add queue": 1,
                                                     "prefill drain idle": 1}


def test_plot_serve_writes_two_pngs(tmp_path: object) -> None:
    pytest.importorskip("matplotlib")

    paths = plot_serve(_report(), os.path.join(str(tmp_path), "serve"))
    assert [os.path.basename(p) for p in paths] == ["serve-itl.png", "serve-queues.png"]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# --- against kvmove-serve -------------------------------------------------------------------


def _serve_available() -> bool:
    try:
        import openai  # noqa: F401

        import kvmove.serve.cli  # noqa: F401
    except ImportError:
        return False
    return True


needs_server = pytest.mark.skipif(not _serve_available(),
                                  reason="needs kvmove.serve and openai (kvmove[serve,test])")


@needs_server
def test_a_server_that_cannot_start_ends_the_run_with_its_error() -> None:
    config = ServeBenchConfig(modes=("colocated",), model="/nonexistent/model", timeout=60)
    with pytest.raises(BenchError, match=r"exited with status 2 before it was ready: .*"
                       "no such directory, and not a preset"):
        serve.run(config)


@needs_server
def test_end_to_end_every_request_completes() -> None:
    config = ServeBenchConfig(modes=("colocated", "disagg"), model="tiny", num_requests=6,
                              rate=20.0, long_prompt_bytes=200, long_output_tokens=4,
                              short_prompt_bytes=20, short_output_tokens=12, chunk_size=64,
                              timeout=60, sample_interval=0.05, planners=("off", "on"))
    labels: list[str] = []
    report = serve.run(config, labels.append)
    assert len(labels) == serve.count_steps(config)
    trace = {t.index: t for t in report.trace}
    for mode in report.modes:
        # Stopped by our SIGTERM, not killed after the deadline: 0, or -SIGTERM where uvicorn
        # re-raises the signal once it has shut down.
        assert mode.exit_code in (0, -signal.SIGTERM), (mode.mode, mode.exit_code)
        assert mode.failures == 0, [r.error for r in mode.requests]
        for r in mode.requests:
            assert r.tokens == trace[r.index].max_tokens == r.max_tokens
        assert mode.samples, "no /metrics sample"
    colocated, disagg, planned = report.modes
    assert colocated.kv_transfers == 0 and disagg.kv_transfers == config.num_requests
    assert disagg.kv_bytes > 0 and disagg.kv_share is not None
    assert {"prefill", "decode"} <= {p for s in disagg.samples for p in s.queued}
    # the same disagg with kvmove-serve --planner: its pools' sizes sampled, within bounds
    assert planned.label == "disagg planner" and planned.kv_transfers == config.num_requests
    sizes = [s.workers for s in planned.samples if s.workers]
    assert sizes and all(1 <= w["prefill"] <= 2 and 1 <= w["decode"] <= 2 for w in sizes)


@needs_server
def test_a_running_server_by_url_and_nothing_left_after_an_error() -> None:
    """``url`` replays against a server started elsewhere (here: by hand); an exception
    inside ``ServerProcess`` still stops the server and every worker of its session."""
    config = ServeBenchConfig(modes=("chunked",), model="tiny", num_requests=3, rate=50.0,
                              long_prompt_bytes=100, long_output_tokens=3, short_prompt_bytes=10,
                              short_output_tokens=5, chunk_size=32, timeout=60)
    with pytest.raises(RuntimeError, match="stop here"):
        with ServerProcess(serve_arguments(config, "chunked"), config.timeout) as server:
            pid = server.proc.pid
            report = serve.run(replace(config, url=server.url + "/"))
            (mode,) = report.modes
            assert mode.failures == 0 and mode.output_tokens == sum(
                t.max_tokens for t in report.trace)
            assert mode.startup_seconds is None and mode.exit_code is None
            raise RuntimeError("stop here")
    assert server.exit_code in (0, -signal.SIGTERM)
    with pytest.raises(ProcessLookupError):  # nothing of its session is left
        os.killpg(pid, 0)
