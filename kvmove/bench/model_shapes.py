"""The model ``kvmove-bench plan`` describes: a preset name or a Hugging Face ``config.json``.

A ``kvmove.kv_spec`` preset names only the KV cache's shape (layers, KV heads, head_dim). The
planner's FLOP count needs the rest of the model (width, MLP, query heads, vocabulary), so
``PRESET_SHAPES`` adds those fields from each model's published ``config.json`` and takes
the KV fields from ``kvmove.kv_spec.PRESETS``, so that each number has one home. A
``config.json`` goes through the engine's own parser (``ModelConfig.from_hf``), which needs
no torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from kvmove.bench import model_arch
from kvmove.bench.model_arch import ARCH_MODEL_TYPES, DENSE, Arch
from kvmove.engine.config import SHAPE_MODEL_TYPES, ModelConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import PRESETS, KVSpec

__all__ = ["PRESET_SHAPES", "ModelChoice", "resolve_model"]

# name: (hidden_size, intermediate_size, num_attention_heads, vocab_size, tie_word_embeddings)
# from each model's config.json on the Hugging Face hub (meta-llama/*, Qwen/*,
# mistralai/Mistral-7B-v0.1).
_DENSE_FIELDS: dict[str, tuple[int, int, int, int, bool]] = {
    "llama-3.2-1b": (2048, 8192, 32, 128256, True),
    "llama-3.2-3b": (3072, 8192, 24, 128256, True),
    "llama-3.1-8b": (4096, 14336, 32, 128256, False),
    "llama-3.1-70b": (8192, 28672, 64, 128256, False),
    "llama-3.1-405b": (16384, 53248, 128, 128256, False),
    "qwen2.5-7b": (3584, 18944, 28, 152064, False),
    "qwen2.5-72b": (8192, 29568, 64, 152064, False),
    "mistral-7b": (4096, 14336, 32, 32000, False),
}


def _preset_shape(name: str) -> ModelConfig:
    num_layers, num_kv_heads, head_dim = PRESETS[name]
    hidden, intermediate, heads, vocab, tied = _DENSE_FIELDS[name]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=num_layers, num_heads=heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, tie_word_embeddings=tied, dtype="bfloat16")


PRESET_SHAPES: dict[str, ModelConfig] = {name: _preset_shape(name) for name in PRESETS}


# "org/name" that is no path here: a Hugging Face model id.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """What ``--model`` named: a display name, the model's shape and its KV layout."""

    name: str
    shape: ModelConfig
    layout: KVSpec
    arch: Arch = DENSE   # MLA and MoE parts (model_arch.py)


def resolve_model(model: str, block_size: int, dtype: str | None = None) -> ModelChoice:
    """``model`` as a preset name, a ``config.json`` file, or a directory holding one.

    Args:
        model: a ``kvmove.kv_spec.PRESETS`` name or a path.
        block_size: tokens per KV block.
        dtype: the KV element type; ``None``: float16 for a preset (as ``KVSpec``), the
            checkpoint's own dtype for a ``config.json``.

    Raises:
        ConfigError: neither a preset nor a readable config, naming both.
    """
    if model in PRESET_SHAPES:
        return ModelChoice(model, PRESET_SHAPES[model],
                           KVSpec.preset(model, dtype=dtype or "float16",
                                           block_size=block_size))
    if not os.path.exists(model):
        if HUB_ID.fullmatch(model):
            raise ConfigError(f"--model {model!r} looks like a Hugging Face id, and kvmove "
                              f"reads no hub (nothing is downloaded): download its config.json "
                              f"(hf download {model} config.json --local-dir DIR) and pass "
                              f"DIR or the file; or a preset ({', '.join(PRESETS)})")
        raise ConfigError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor "
                          "a config.json or a directory holding one")
    hf = ModelConfig.read_hf_file(model)
    model_type = hf.get("model_type", "llama")
    if model_type not in SHAPE_MODEL_TYPES + ARCH_MODEL_TYPES:
        raise ConfigError(f"--model {model!r}: model_type {model_type!r} is not one the "
                          f"planner reads ({', '.join(SHAPE_MODEL_TYPES + ARCH_MODEL_TYPES)})")
    if model_type in ARCH_MODEL_TYPES:
        shape, arch = model_arch.from_hf(hf)
    else:
        shape, arch = ModelConfig.from_hf(hf, shape_only=True), DENSE
    layout = arch.kv_spec(shape, block_size)
    return ModelChoice(os.path.normpath(model), shape,
                       replace(layout, dtype=dtype) if dtype else layout, arch)
