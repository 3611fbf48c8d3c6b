"""Tests of the planner's prefill estimate (``kvmove/bench/prefill.py``): the FLOP count
against a hand computation and against the engine's own parameters, the accelerator table
and its rejections, and the engine-report path.

Llama-3.1-8B by hand (hidden 4096, 32 heads and 8 KV heads of 128, MLP 14336, 32 layers,
vocabulary 128256):

    per layer  q, o: 2 * 4096 * 32 * 128 = 33,554,432;  k, v: 2 * 4096 * 8 * 128 = 8,388,608
               MLP: 3 * 4096 * 14336 = 176,160,768;  in all 218,103,808
    P          32 * 218,103,808 = 6,979,321,856
    4,000 tokens: weights 2 * P * 4000 = 55,834,574,848,000
                  LM head 2 * 4096 * 128256 = 1,050,673,152
                  attention 2 * 32 layers * 32 heads * 128 * 4000 * 4001 = 4,195,352,576,000
                  total 60,030,978,097,152
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvmove.bench.model_shapes import PRESET_SHAPES
from kvmove.bench.prefill import (
    ACCELERATORS,
    DEFAULT_UTILIZATION,
    Accelerator,
    from_engine_report,
    given,
    matmul_params,
    on_accelerator,
    parse_accelerator,
    prefill_flops,
)
from kvmove.engine.config import MODEL_PRESETS, ModelConfig
from kvmove.errors import ConfigError

LLAMA_8B = PRESET_SHAPES["llama-3.1-8b"]
LLAMA_8B_4000_FLOPS = 60_030_978_097_152


def test_llama_8b_matmul_params_by_hand() -> None:
    assert matmul_params(LLAMA_8B) == 6_979_321_856


def test_llama_8b_4000_token_flops_by_hand() -> None:
    flops = prefill_flops(LLAMA_8B, 4000)
    assert flops.weights == 55_834_574_848_000
    assert flops.lm_head == 1_050_673_152
    assert flops.attention == 4_195_352_576_000
    assert flops.total == LLAMA_8B_4000_FLOPS


def test_llama_8b_preset_has_the_published_parameter_count() -> None:
    """Matmuls + embedding + LM head + norms (2 per layer and a final one) = 8,030,261,248,
    the count of meta-llama/Llama-3.1-8B's weights: the preset's shape is the real one."""
    c = LLAMA_8B
    norms = (2 * c.num_layers + 1) * c.hidden_size
    assert matmul_params(c) + 2 * c.vocab_size * c.hidden_size + norms == 8_030_261_248


def test_attention_term_counts_the_causal_pairs() -> None:
    """Query i sees keys 0..i; each pair costs head_dim MACs for QK^T and as many for PV."""
    c = ModelConfig(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    tokens = 7
    pairs = sum(i + 1 for i in range(tokens))
    expected = c.num_layers * c.num_heads * pairs * c.head_dim * 2 * 2  # 2 matmuls, 2 per MAC
    assert prefill_flops(c, tokens).attention == expected


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_matmul_params_are_the_engine_models_projection_weights(name: str) -> None:
    """Reference: the engine's own LlamaForCausalLM, every ``*_proj`` weight of its layers."""
    torch = pytest.importorskip("torch")
    from kvmove.engine.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(MODEL_PRESETS[name])
    counted = sum(p.numel() for n, p in model.named_parameters()
                  if n.startswith("model.layers.") and n.endswith("_proj.weight"))
    assert matmul_params(MODEL_PRESETS[name]) == counted


def test_time_on_an_accelerator_by_hand() -> None:
    estimate = on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h100"])
    expected_ms = LLAMA_8B_4000_FLOPS / (989.5e12 * DEFAULT_UTILIZATION) * 1e3  # 151.67 ms
    assert estimate.ms == pytest.approx(expected_ms, rel=1e-12)
    assert estimate.source == "flops"
    for text in ("H100 SXM", "989.5 TFLOP/s dense bf16 peak", "40% utilisation assumed"):
        assert text in estimate.basis


def test_tensor_parallel_and_utilization_divide_the_time() -> None:
    one = on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h200"], tp=1, utilization=0.5).ms
    eight = on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h200"], tp=8, utilization=0.25).ms
    assert eight == pytest.approx(one / 8 * 2, rel=1e-12)


def test_prefill_time_grows_faster_than_the_prompt() -> None:
    """The attention term is quadratic: 32x the tokens costs more than 32x the time."""
    short = on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h100"]).ms
    long = on_accelerator(LLAMA_8B, 128_000, ACCELERATORS["h100"]).ms
    assert long > 32 * short * 1.5


@pytest.mark.parametrize(("text", "expected"),
                         [("h100", ACCELERATORS["h100"]), ("B200", ACCELERATORS["b200"]),
                          ("MI300X=1307.4", Accelerator("MI300X", 1307.4)),
                          (" L40S = 362 ", Accelerator("L40S", 362.0))])
def test_parse_accelerator(text: str, expected: Accelerator) -> None:
    assert parse_accelerator(text) == expected


@pytest.mark.parametrize("text", ["h900", "=5", "x=", "x=fast", "x=0", "x=-1", "x=inf"])
def test_rejects_bad_accelerator(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--gpu|TFLOP/s"):
        parse_accelerator(text)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_rejects_bad_utilization(utilization: float) -> None:
    with pytest.raises(ConfigError, match=rf"utilization must be in \(0, 1\], got {utilization}"):
        on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h100"], utilization=utilization)


@pytest.mark.parametrize("tp", [0, -2, 1.5])
def test_rejects_bad_tp(tp: object) -> None:
    with pytest.raises(ConfigError, match=rf"tp .*{tp}"):
        on_accelerator(LLAMA_8B, 4000, ACCELERATORS["h100"], tp=tp)  # type: ignore[arg-type]


def test_rejects_bad_given_time() -> None:
    with pytest.raises(ConfigError, match="prefill_ms"):
        given(0.0)


# --- from this machine's engine measurement -------------------------------------------------

def _engine_report(path: Path, seconds: float = 2.0, tokens: int = 2000) -> str:
    """What ``kvmove-bench engine --json`` writes, reduced to the fields the planner reads."""
    report = {"model": asdict(MODEL_PRESETS["small"]),
              "prefill": {"batch_size": 1, "prompt_tokens": tokens, "median_seconds": seconds}}
    path.write_text(json.dumps(report))
    return str(path)


def test_engine_rate_scaled_by_flops(tmp_path: Path) -> None:
    report = _engine_report(tmp_path / "engine.json", seconds=2.0, tokens=2000)
    rate = prefill_flops(MODEL_PRESETS["small"], 2000).total / 2.0  # FLOP/s reached here
    estimate = from_engine_report(LLAMA_8B, 4000, report)
    assert estimate.ms == pytest.approx(LLAMA_8B_4000_FLOPS / rate * 1e3, rel=1e-12)
    assert estimate.source == "engine"
    assert "this machine's engine prefill (2,000 tokens in 2,000 ms" in estimate.basis


@pytest.mark.parametrize("content", ["not json", "[]", '{"model": {}}',
                                     '{"model": {"hidden_size": -1}, "prefill": {}}'])
def test_rejects_what_is_not_an_engine_report(tmp_path: Path, content: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"--engine-report .*x.json|hidden_size"):
        from_engine_report(LLAMA_8B, 4000, str(path))


def test_rejects_a_missing_engine_report(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing.json"):
        from_engine_report(LLAMA_8B, 4000, str(tmp_path / "nothing.json"))
