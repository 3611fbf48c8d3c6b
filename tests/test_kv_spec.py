"""KVSpec arithmetic against hand-computed model numbers, and every rejection path."""

from __future__ import annotations

import dataclasses

import pytest

from kvmove import KVSpec
from kvmove.errors import ConfigError
from kvmove.kv_spec import DTYPE_BYTES, PRESETS


def test_llama_3_1_8b_numbers_from_the_design_brief():
    lay = KVSpec.preset("llama-3.1-8b")
    assert lay.bytes_per_token_per_layer == 4096
    assert lay.bytes_per_token == 131_072
    assert lay.bytes_for(4000) == 524_288_000


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim"),
    [
        ("llama-3.1-8b", 32, 8, 128),
        ("llama-3.1-70b", 80, 8, 128),
        ("qwen2.5-7b", 28, 4, 128),
        ("mistral-7b", 32, 8, 128),
    ],
)
def test_presets_match_model_configs(name, layers, kv_heads, head_dim):
    lay = KVSpec.preset(name)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim) == (layers, kv_heads, head_dim)
    assert lay.bytes_per_token == 2 * kv_heads * head_dim * 2 * layers


@pytest.mark.parametrize(("dtype", "nbytes"), [("float32", 4), ("float16", 2), ("bfloat16", 2),
                                               ("float8", 1)])
def test_dtype_sizes(dtype, nbytes):
    lay = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dtype)
    assert lay.dtype_bytes == nbytes
    assert lay.bytes_per_token_per_layer == 2 * nbytes


def test_block_sizes():
    lay = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", block_size=8)
    assert lay.bytes_per_token_per_layer == 2 * 2 * 4 * 4
    assert lay.bytes_per_block_per_layer == 8 * 64
    assert lay.bytes_per_block == 3 * 8 * 64
    assert lay.blocks_for(0) == 0
    assert lay.blocks_for(1) == 1
    assert lay.blocks_for(8) == 1
    assert lay.blocks_for(9) == 2


def test_preset_overrides():
    lay = KVSpec.preset("llama-3.1-8b", dtype="float8", block_size=64)
    assert lay.bytes_per_token_per_layer == 2048
    assert lay.block_size == 64


def test_every_preset_is_valid():
    for name in PRESETS:
        assert KVSpec.preset(name).bytes_per_token > 0


def test_layout_is_frozen():
    lay = KVSpec.preset("mistral-7b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_layers = 1  # type: ignore[misc]


def test_unknown_preset_names_the_value_and_choices():
    with pytest.raises(ConfigError, match="llama-9.*known: llama-3.2-1b"):
        KVSpec.preset("llama-9")


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_dimensions_rejected(field, bad):
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, field: bad}
    with pytest.raises(ConfigError, match=f"{field} must be positive, got {bad}"):
        KVSpec(**args)


@pytest.mark.parametrize("bad", [2.0, "8", True, None])
def test_non_int_dimensions_rejected(bad):
    with pytest.raises(ConfigError, match="head_dim must be an int"):
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=bad)


def test_block_size_must_be_power_of_two():
    with pytest.raises(ConfigError, match="block_size must be a power of two, got 48"):
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=48)


def test_unknown_dtype_rejected():
    with pytest.raises(ConfigError, match="dtype must be one of .* got 'int8'"):
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="int8")
    assert "int8" not in DTYPE_BYTES


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        KVSpec(num_layers=0, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("method", ["bytes_for", "blocks_for"])
def test_negative_token_counts_rejected(method):
    with pytest.raises(ConfigError, match="num_tokens must be >= 0, got -1"):
        getattr(KVSpec.preset("llama-3.1-8b"), method)(-1)


def test_the_old_name_is_the_same_class() -> None:
    """``KVLayout`` was renamed ``KVSpec`` ("layout" means NHD/HND to vLLM and FlashInfer
    users); code written for the old name keeps working, with the very same class."""
    import kvmove
    from kvmove.kv_spec import KVLayout

    assert kvmove.KVLayout is kvmove.KVSpec is KVLayout
    assert "KVLayout" not in kvmove.__all__  # one name in the reference: the new one
