"""``kvmove-bench plan`` for the models P/D is most used for (``kvmove/bench/model_arch.py``):
MLA (DeepSeek-V3: one latent per token and layer) and MoE (active parameters for the FLOPs),
read from their published ``config.json`` fields. The active-parameter counts are checked
against the numbers each model's authors publish (embedding and LM head included)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmove.bench.model_shapes import resolve_model
from kvmove.bench.prefill import matmul_params, prefill_flops
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

from helpers.plan import write_config

# The fields the planner reads, as in each model's config.json on the Hugging Face hub.
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
               "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "vocab_size": 129280,
               "torch_dtype": "bfloat16"}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                "torch_dtype": "bfloat16"}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
                 "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(("config", "active_billions"), [
    (DEEPSEEK_V3, 37.0),    # "37B activated for each token" (DeepSeek-V3 report)
    (MIXTRAL_8X7B, 12.9),   # "12.9B active parameters per token" (Mixtral paper)
    (QWEN3_30B_A3B, 3.3),   # "3.3B activated" (Qwen3 model card)
], ids=["deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_flops_count_the_active_parameters(tmp_path: Path, config: dict,
                                               active_billions: float) -> None:
    choice = resolve_model(str(write_config(tmp_path, config)), 16)
    embed_and_head = 2 * choice.shape.hidden_size * choice.shape.vocab_size
    active = matmul_params(choice.shape, choice.arch) + embed_and_head
    assert active == pytest.approx(active_billions * 1e9, rel=0.03)
    flops = prefill_flops(choice.shape, 1000, choice.arch)
    assert flops.weights == 2.0 * matmul_params(choice.shape, choice.arch) * 1000


def test_deepseek_v3_caches_one_latent_per_token_and_layer(tmp_path: Path) -> None:
    """512 + 64 elements, bf16: 1,152 bytes per token and layer, 70,272 over 61 layers (its
    128 heads of K and V would take 4.8 MiB a token): what the plan moves."""
    choice = resolve_model(str(write_config(tmp_path, DEEPSEEK_V3)), 64)
    assert choice.layout == KVSpec(61, 1, 576, dtype="bfloat16", block_size=64, mla=True)
    assert choice.layout.bytes_per_token_per_layer == 1152
    assert choice.arch.describe() == ("MLA latent 576 per token and layer; "
                                      "MoE 8 of 256 experts + 1 shared active")


def test_mla_attention_flops_use_its_query_and_value_dimensions(tmp_path: Path) -> None:
    choice = resolve_model(str(write_config(tmp_path, DEEPSEEK_V3)), 16)
    tokens = 1000
    flops = prefill_flops(choice.shape, tokens, choice.arch)
    assert flops.attention == 61 * 128 * (128 + 64 + 128) * tokens * (tokens + 1)


def test_plan_prints_the_architecture_and_the_latents_bytes(tmp_path: Path) -> None:
    path = write_config(tmp_path, DEEPSEEK_V3)
    out = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "plan", "--model",
                          str(path), "--tokens", "8000", "--json"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert "MLA latent 576" in json.dumps(plan) and "8 of 256 experts" in json.dumps(plan)
    assert 61 * 576 * 2 * 8000 in _ints(plan)


def _ints(value: object) -> set[int]:
    if isinstance(value, dict):
        return set().union(*(_ints(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_ints(v) for v in value)) if value else set()
    return {value} if isinstance(value, int) and not isinstance(value, bool) else set()


def test_a_missing_mla_field_is_named(tmp_path: Path) -> None:
    config = {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="'deepseek_v3' has no 'kv_lora_rank'"):
        resolve_model(str(write_config(tmp_path, config)), 16)


def test_a_model_type_the_planner_cannot_read_names_those_it_can(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model_type 'gemma3' is not one the planner reads "
                                          r"\(llama, .*deepseek_v3, mixtral, qwen3_moe\)"):
        resolve_model(str(write_config(tmp_path, {**MIXTRAL_8X7B, "model_type": "gemma3"})), 16)


def test_plan_plot_draws_the_links_against_the_prefill(tmp_path: Path) -> None:
    """``--plot``: a PNG of the transfer per link beside the prefill (matplotlib, the bench
    extra, which the test extra carries too)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    out = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "plan", "--model",
                          str(write_config(tmp_path, DEEPSEEK_V3)), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
