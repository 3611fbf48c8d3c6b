"""Tests of ``kvmove-bench plan``'s model input (``kvmove/bench/model_shapes.py``) and of the
engine's config parser it goes through (``ModelConfig.from_hf`` / ``from_hf_file``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmove.bench.model_shapes import PRESET_SHAPES, resolve_model
from kvmove.engine.config import ModelConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import PRESETS, KVSpec

from helpers.plan import LLAMA_31_8B_CONFIG, write_config


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes_agree_with_the_kv_presets(name: str) -> None:
    shape = PRESET_SHAPES[name]
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == PRESETS[name]
    assert shape.num_heads * shape.head_dim == shape.hidden_size


def test_a_config_json_gives_the_presets_shape(tmp_path: Path) -> None:
    path = write_config(tmp_path / "llama", LLAMA_31_8B_CONFIG)
    for where in (str(path), str(path.parent)):  # the file, or its directory
        choice = resolve_model(where, block_size=16)
        assert choice.shape.num_layers == 32 and choice.shape.intermediate_size == 14336
        assert choice.layout == KVSpec(32, 8, 128, dtype="bfloat16", block_size=16)
    for field in ("hidden_size", "intermediate_size", "num_heads", "vocab_size"):
        assert getattr(choice.shape, field) == getattr(PRESET_SHAPES["llama-3.1-8b"], field)


def test_a_preset_keeps_float16_kv_and_dtype_overrides(tmp_path: Path) -> None:
    assert resolve_model("llama-3.1-8b", 16).layout.dtype == "float16"
    path = write_config(tmp_path, LLAMA_31_8B_CONFIG)
    assert resolve_model(str(path), 32, "float8").layout == KVSpec(32, 8, 128, "float8", 32)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_shape_only_reads_dense_llama_shaped_types(model_type: str) -> None:
    shape = ModelConfig.from_hf({**LLAMA_31_8B_CONFIG, "model_type": model_type},
                                shape_only=True)
    assert shape.num_kv_heads == 8


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_shape_only_refuses_other_types(model_type: str) -> None:
    with pytest.raises(ConfigError, match=rf"model_type '{model_type}'"):
        ModelConfig.from_hf({**LLAMA_31_8B_CONFIG, "model_type": model_type}, shape_only=True)


def test_the_engine_still_refuses_a_scaled_rope() -> None:
    """One parser, two uses: the planner reads Llama 3.1's shape, the engine cannot run its
    llama3 rope scaling and says so."""
    with pytest.raises(ConfigError, match="rope_scaling"):
        ModelConfig.from_hf(LLAMA_31_8B_CONFIG)
    with pytest.raises(ConfigError, match="model_type 'qwen2'"):
        ModelConfig.from_hf({**LLAMA_31_8B_CONFIG, "model_type": "qwen2", "rope_scaling": None})


def test_rejects_a_path_that_is_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'nowhere' is neither a preset .*config.json"):
        resolve_model("nowhere", 16)


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-V3"])
def test_a_hugging_face_id_gets_told_to_download_its_config(model: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{model}' looks like a Hugging Face id, .*"
                                          rf"hf download {model} config.json --local-dir DIR"):
        resolve_model(model, 16)


def test_a_missing_path_with_a_slash_is_no_hugging_face_id() -> None:
    with pytest.raises(ConfigError, match=r"is neither a preset"):
        resolve_model("./models/x", 16)


def test_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path), 16)


@pytest.mark.parametrize(("content", "message"), [("{not json", "cannot read"),
                                                  ("[1, 2]", "JSON list, not an object"),
                                                  ('{"hidden_size": 0}', "hidden_size")])
def test_rejects_a_bad_config_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        resolve_model(str(path), 16)
