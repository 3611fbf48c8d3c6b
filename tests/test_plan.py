"""Tests of the disaggregation planner (``kvmove/bench/plan.py``) and ``kvmove-bench plan``.

Expected numbers are computed by hand from DESIGN.md §1: Llama-3.1-8B keeps
2 * 8 KV heads * 128 * 2 B = 4,096 B per token per layer, * 32 layers = 131,072 B per token,
* 4,000 tokens = 524,288,000 B.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmove.bench.cli import main
from kvmove.bench.plan import (
    CHEAP_SHARE_PCT,
    DEFAULT_LINKS,
    TOO_SLOW_SHARE_PCT,
    Link,
    Verdict,
    exposed_ms,
    merge_links,
    parse_link,
    plan,
    verdict_for,
)
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

from helpers.checks import WORKDIR
from helpers.plan import write_llama_8b_config

LLAMA_8B_4000_BYTES = 524_288_000

Bench = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def llama() -> KVSpec:
    return KVSpec.preset("llama-3.1-8b")


def streamed_reference(transfer_ms: float, prefill_ms: float, num_layers: int) -> float:
    """Event-by-event reference: layer i is ready at (i+1)·p/L and queues on one link."""
    link_free = 0.0
    for i in range(num_layers):
        ready = (i + 1) * prefill_ms / num_layers
        link_free = max(ready, link_free) + transfer_ms / num_layers
    return link_free - prefill_ms


def re_value(value: object) -> str:
    """How an error message spells ``value``, escaped for ``pytest.raises(match=...)``."""
    return re.escape(repr(value))


# --- sizes and transfer times ---------------------------------------------------------------

def test_llama_8b_4000_tokens_is_524288000_bytes(llama: KVSpec) -> None:
    result = plan(llama, 4000)
    assert result.kv_bytes == LLAMA_8B_4000_BYTES
    assert result.bytes_per_token == 131_072
    assert result.num_blocks == 250


@pytest.mark.parametrize(
    ("name", "expected_ms"),
    [
        ("NVLink", 524288000 / 900e9 * 1e3),  # 0.5825 ms
        ("InfiniBand 400G", 524288000 / 50e9 * 1e3),  # 10.486 ms
        ("Ethernet 25G", 524288000 / 3.1e9 * 1e3),  # 169.13 ms
    ],
)
def test_transfer_ms_of_default_links(llama: KVSpec, name: str, expected_ms: float) -> None:
    row = plan(llama, 4000).row(name)
    assert row.transfer_ms == pytest.approx(expected_ms, rel=1e-12)
    assert row.prefill_share_pct == pytest.approx(expected_ms / 200.0 * 100.0, rel=1e-12)


def test_default_links_are_the_design_table() -> None:
    assert [(link.name, link.gbytes_per_s) for link in DEFAULT_LINKS] == [
        ("NVLink", 900.0), ("InfiniBand 400G", 50.0), ("Ethernet 25G", 3.1)
    ]


# --- verdicts -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "verdict"),
    [("NVLink", Verdict.CHEAP), ("InfiniBand 400G", Verdict.CHEAP),
     ("Ethernet 25G", Verdict.TOO_SLOW)],
)
def test_verdicts_of_default_links_at_200_ms(llama: KVSpec, name: str, verdict: Verdict) -> None:
    assert plan(llama, 4000, prefill_ms=200.0).row(name).verdict is verdict


@pytest.mark.parametrize(
    ("share_pct", "verdict"),
    [(0.0, Verdict.CHEAP), (CHEAP_SHARE_PCT, Verdict.CHEAP), (10.01, Verdict.MARGINAL),
     (TOO_SLOW_SHARE_PCT, Verdict.MARGINAL), (50.01, Verdict.TOO_SLOW), (500.0, Verdict.TOO_SLOW)],
)
def test_verdict_thresholds(share_pct: float, verdict: Verdict) -> None:
    assert verdict_for(share_pct) is verdict


def test_shorter_prefill_makes_infiniband_marginal(llama: KVSpec) -> None:
    # 10.486 ms of transfer against a 50 ms prefill is 21 %.
    assert plan(llama, 4000, prefill_ms=50.0).row("InfiniBand 400G").verdict is Verdict.MARGINAL


# --- exposed transfer with layer-wise streaming ---------------------------------------------

def test_exposed_when_link_outpaces_compute(llama: KVSpec) -> None:
    # t = 10.486 ms <= p = 200 ms: only the last layer's t/32 sticks out.
    row = plan(llama, 4000, prefill_ms=200.0).row("InfiniBand 400G")
    assert row.exposed_ms == pytest.approx(524288000 / 50e9 * 1e3 / 32, rel=1e-12)  # 0.32768


def test_exposed_when_link_is_the_bottleneck(llama: KVSpec) -> None:
    # t = 169.125 ms > p = 100 ms: t/32 + (t - 100) * 31/32 = t - 100 * 31/32 = t - 96.875.
    t = 524288000 / 3.1e9 * 1e3
    row = plan(llama, 4000, prefill_ms=100.0).row("Ethernet 25G")
    assert row.exposed_ms == pytest.approx(t - 96.875, rel=1e-12)  # 72.25 ms


@pytest.mark.parametrize(
    ("t", "p", "layers", "expected"),
    [(8.0, 32.0, 4, 2.0), (32.0, 32.0, 4, 8.0), (64.0, 32.0, 4, 40.0), (10.0, 5.0, 1, 10.0)],
)
def test_exposed_ms_by_hand(t: float, p: float, layers: int, expected: float) -> None:
    assert exposed_ms(t, p, layers) == pytest.approx(expected)


@pytest.mark.parametrize("t", [0.5, 10.0, 99.0, 100.0, 101.0, 169.1, 3000.0])
@pytest.mark.parametrize("layers", [1, 2, 32, 80])
def test_exposed_ms_matches_event_reference(t: float, layers: int) -> None:
    assert exposed_ms(t, 100.0, layers) == pytest.approx(streamed_reference(t, 100.0, layers))


# --- advice ---------------------------------------------------------------------------------

def test_advice_follows_the_verdicts(llama: KVSpec) -> None:
    advice = plan(llama, 4000).advice
    slow = next(line for line in advice if "don't disaggregate" in line)
    cheap = next(line for line in advice if "tens of GPUs with RDMA" in line)
    assert "Ethernet 25G" in slow and "NVLink" not in slow
    assert "NVLink" in cheap and "InfiniBand 400G" in cheap and "Ethernet" not in cheap
    assert any("chunked prefill first, then disaggregate" in line for line in advice)
    assert any("extremely skewed input/output lengths" in line for line in advice)


def test_advice_when_no_link_is_fast_enough(llama: KVSpec) -> None:
    advice = plan(llama, 4000, links=[Link("Ethernet 25G", 3.1)]).advice
    assert any("don't disaggregate over Ethernet 25G" in line for line in advice)
    assert any("stay colocated" in line for line in advice)
    assert not any("consider disaggregation" in line for line in advice)


def test_advice_names_marginal_links(llama: KVSpec) -> None:
    advice = plan(llama, 4000, prefill_ms=50.0, links=[Link("InfiniBand 400G", 50.0)]).advice
    assert any(line.startswith("InfiniBand 400G") and "marginal" in line for line in advice)


def test_to_dict_is_plain_json(llama: KVSpec) -> None:
    data = json.loads(json.dumps(plan(llama, 4000, model="llama-3.1-8b").to_dict()))
    assert data["kv_bytes"] == LLAMA_8B_4000_BYTES
    assert data["model"] == "llama-3.1-8b"
    assert data["layout"]["num_layers"] == 32
    assert [link["verdict"] for link in data["links"]] == ["cheap", "cheap", "too_slow"]


# --- links ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "link"),
    [("RoCE=12.5", Link("RoCE", 12.5)), ("RoCE 100G=12", Link("RoCE 100G", 12.0)),
     (" PCIe 5 = 50 ", Link("PCIe 5", 50.0))],
)
def test_parse_link(text: str, link: Link) -> None:
    assert parse_link(text) == link


def test_merge_links_adds_and_replaces_by_name() -> None:
    merged = merge_links(DEFAULT_LINKS, [Link("RoCE", 12.0), Link("NVLink", 450.0)])
    assert [(link.name, link.gbytes_per_s) for link in merged] == [
        ("NVLink", 450.0), ("InfiniBand 400G", 50.0), ("Ethernet 25G", 3.1), ("RoCE", 12.0)
    ]


# --- rejections -----------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [0, -1, 1.5, True, "4000", None])
def test_rejects_bad_num_tokens(llama: KVSpec, num_tokens: object) -> None:
    with pytest.raises(ConfigError, match=rf"num_tokens .*{re_value(num_tokens)}"):
        plan(llama, num_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefill_ms", [0.0, -5.0, math.nan, math.inf, "200", True])
def test_rejects_bad_prefill_ms(llama: KVSpec, prefill_ms: object) -> None:
    with pytest.raises(ConfigError, match=rf"prefill_ms .*{re_value(prefill_ms)}"):
        plan(llama, 4000, prefill_ms)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["NVLink", "=5", "x=", "x=abc", "x=-1", "x=0", "x=inf", "x=nan"])
def test_rejects_bad_link_text(text: str) -> None:
    with pytest.raises(ConfigError, match=r"link"):
        parse_link(text)


@pytest.mark.parametrize(("name", "gbytes_per_s"), [("", 1.0), ("  ", 1.0), ("x", 0.0),
                                                    ("x", -1.0), ("x", math.inf)])
def test_rejects_bad_link(name: str, gbytes_per_s: float) -> None:
    with pytest.raises(ConfigError, match="link"):
        Link(name, gbytes_per_s)


def test_rejects_duplicate_link_names(llama: KVSpec) -> None:
    with pytest.raises(ConfigError, match="'NVLink' twice"):
        plan(llama, 4000, links=[Link("NVLink", 900.0), Link("NVLink", 450.0)])


def test_rejects_no_links(llama: KVSpec) -> None:
    with pytest.raises(ConfigError, match="at least one"):
        plan(llama, 4000, links=())


def test_rejects_unknown_model() -> None:
    with pytest.raises(ConfigError, match="'llama-9'"):
        KVSpec.preset("llama-9")


def test_rejects_unknown_link_in_row(llama: KVSpec) -> None:
    with pytest.raises(ConfigError, match="'Token Ring'"):
        plan(llama, 4000).row("Token Ring")


# --- CLI in process -------------------------------------------------------------------------

def test_main_without_subcommand_runs_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "524,288,000 B" in out and "Ethernet 25G" in out


def test_main_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json", "--link", "RoCE=12.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes"] == LLAMA_8B_4000_BYTES
    assert data["links"][-1]["name"] == "RoCE"


def test_main_dtype_and_block_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json", "--dtype", "float8", "--block-size", "32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes"] == LLAMA_8B_4000_BYTES // 2
    assert data["num_blocks"] == 125


def test_main_rejects_bad_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--tokens", "0"]) == 2
    assert "got 0" in capsys.readouterr().err


# --- CLI as a real process ------------------------------------------------------------------

def bench_commands() -> list[list[str]]:
    """``python -m kvmove.bench.cli``, and the installed script when there is one."""
    commands = [[sys.executable, "-m", "kvmove.bench.cli"]]
    # The venv's bin/ may not be on PATH when pytest runs as .venv/bin/python -m pytest.
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if script := shutil.which("kvmove-bench", path=search):
        commands.append([script])
    return commands


@pytest.fixture(params=bench_commands(), ids=lambda command: os.path.basename(command[-1]))
def bench(request: pytest.FixtureRequest, tmp_path: Path) -> Bench:
    """Runs the CLI in a scratch directory, so only the installed package can be imported."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*request.param, *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
    return run


def test_cli_plan_text(bench: Bench) -> None:
    result = bench("plan", "--model", "llama-3.1-8b", "--tokens", "4000", "--link", "RoCE=12.5")
    assert result.returncode == 0, result.stderr
    for text in ("llama-3.1-8b", "524,288,000 B", "131,072 B/token", "NVLink",
                 "InfiniBand 400G", "Ethernet 25G", "RoCE", "too_slow", "cheap",
                 "don't disaggregate", "chunked prefill first, then disaggregate",
                 "extremely skewed input/output lengths"):
        assert text in result.stdout, text
    assert result.stderr == ""


def test_cli_plan_json(bench: Bench) -> None:
    result = bench("plan", "--json", "--tokens", "4000")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kv_bytes"] == LLAMA_8B_4000_BYTES
    assert [link["name"] for link in data["links"]] == ["NVLink", "InfiniBand 400G",
                                                        "Ethernet 25G"]


@pytest.mark.parametrize(
    ("args", "value"),
    [(["plan", "--model", "llama-9"], "llama-9"),
     (["plan", "--link", "fast"], "fast"),
     (["plan", "--link", "x=abc"], "abc"),
     (["plan", "--tokens", "0"], "got 0"),
     (["plan", "--prefill-ms", "-3"], "-3"),
     (["plan", "--block-size", "48"], "48")],
)
def test_cli_bad_input_exits_2(bench: Bench, args: list[str], value: str) -> None:
    result = bench(*args)
    assert result.returncode == 2
    assert value in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# --- the prefill it compares against, and --model config.json -------------------------------

def _plan_json(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "plan", "--json", *args],
                            capture_output=True, text=True, cwd=WORKDIR, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_main_estimates_the_prefill_from_flops(capsys: pytest.CaptureFixture[str]) -> None:
    """No --prefill-ms: the FLOPs of this model and prompt on --gpu (tests/test_prefill.py
    checks the count by hand), with the peak and the assumed utilisation printed beside it."""
    assert main(["plan", "--gpu", "h200", "--tp", "2", "--utilization", "0.5"]) == 0
    out = capsys.readouterr().out
    expected_ms = 60_030_978_097_152 / (2 * 989.5e12 * 0.5) * 1e3  # 60.66 ms
    assert f"prefill {expected_ms:.4g} ms (estimated: 6e+13 FLOPs on 2 x H200 SXM at " \
           "989.5 TFLOP/s dense bf16 peak, 50% utilisation assumed)" in out


def test_main_says_a_given_prefill_was_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--prefill-ms", "200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prefill_ms"] == 200.0
    assert data["prefill"] == {"ms": 200.0, "source": "given", "basis": "given"}


def test_main_uses_this_machines_engine_report(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import asdict

    from kvmove.engine.config import MODEL_PRESETS

    report = tmp_path / "engine.json"
    report.write_text(json.dumps({"model": asdict(MODEL_PRESETS["small"]), "prefill": {
        "prompt_tokens": 2000, "median_seconds": 2.18}}))
    assert main(["plan", "--engine-report", str(report), "--json"]) == 0
    prefill = json.loads(capsys.readouterr().out)["prefill"]
    assert prefill["source"] == "engine" and prefill["engine_seconds"] == 2.18
    assert "this machine's engine prefill (2,000 tokens in 2,180 ms" in prefill["basis"]


@pytest.mark.parametrize(("tokens", "verdict"), [(1000, "too_slow"), (128_000, "marginal")])
def test_the_verdict_changes_with_the_prompt_length(tokens: int, verdict: str) -> None:
    """KV bytes grow with the prompt, the prefill's attention with its square: over Ethernet
    25G an H100's 8B prefill of 1,000 tokens takes less time than sending its KV (too slow),
    one of 128,000 tokens about twice as long as the transfer (marginal)."""
    data = _plan_json("--tokens", str(tokens))
    ethernet = next(link for link in data["links"] if link["name"] == "Ethernet 25G")
    assert ethernet["verdict"] == verdict, ethernet


def test_plan_model_config_json_equals_the_preset(tmp_path: Path) -> None:
    """``--model config.json`` (or its directory) goes through the engine's parser: the same
    shape as the preset gives the same KV bytes and the same estimated prefill."""
    config = write_llama_8b_config(tmp_path / "Llama-3.1-8B")
    preset = _plan_json("--tokens", "4000")
    for where in (config, config.parent):
        data = _plan_json("--model", str(where), "--tokens", "4000", "--dtype", "float16")
        assert data["model"] == str(config.parent if where == config.parent else config)
        assert data["kv_bytes"] == LLAMA_8B_4000_BYTES
        assert data["prefill_ms"] == pytest.approx(preset["prefill_ms"], rel=1e-12)
        assert data["links"] == preset["links"]


def test_plan_stays_torch_free(tmp_path: Path) -> None:
    """A preset or a config.json: kvmove-bench plan imports no torch (it may not be there)."""
    config = write_llama_8b_config(tmp_path)
    check = ("import sys; from kvmove.bench.cli import main; "
             f"assert main(['plan']) == main(['plan', '--model', {str(config)!r}]) == 0; "
             "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            cwd=WORKDIR, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("args", "value"),
    [(["--model", "no/such/config.json"], "no/such/config.json"),
     (["--gpu", "h900"], "h900"),
     (["--tp", "0"], "got 0"),
     (["--utilization", "2"], "got 2.0"),
     (["--prefill-ms", "100", "--engine-report", "x.json"], "not allowed with"),
     (["--engine-report", "missing.json"], "missing.json")],
)
def test_cli_bad_prefill_input_exits_2(bench: Bench, args: list[str], value: str) -> None:
    result = bench("plan", *args)
    assert result.returncode == 2
    assert value in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
