"""A Llama model's shape (``ModelConfig``), read from a Hugging Face ``config.json``.

Kept apart from ``model.py`` because it needs no torch: ``kvmove-bench plan`` reads a
checkpoint's shape through this one parser to count its FLOPs and KV bytes, where torch may
not be installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

if TYPE_CHECKING:
    import torch

__all__ = ["MODEL_PRESETS", "SHAPE_MODEL_TYPES", "ModelConfig"]

# model_type values whose config.json spells a dense decoder's shape with Llama's field names
# (layers, heads, KV heads, head_dim, MLP width, vocabulary). ``from_hf(shape_only=True)``
# accepts them; the engine runs only "llama". Mixture-of-experts and MLA types (e.g.
# "qwen3_moe", "mixtral", "deepseek_v3") are left out on purpose: their intermediate_size is
# one expert's and their KV is no K and V per head, so a dense shape would be wrong; the
# planner reads them with kvmove.bench.model_arch.
SHAPE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama model's shape. ``head_dim`` defaults to ``hidden_size // num_heads``."""

    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 172
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    bos_token_id: int = 256
    eos_token_id: int = 257

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{f} must be a positive int, got {value!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of "
                                  f"num_heads {self.num_heads}: give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be positive and even (rotary), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads {self.num_kv_heads} must divide num_heads "
                              f"{self.num_heads}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        for f in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, f) < self.vocab_size:
                raise ConfigError(f"{f} {getattr(self, f)} is outside the vocabulary "
                                  f"[0, {self.vocab_size})")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ConfigError("rope_theta and rms_norm_eps must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # only the engine asks, and it has torch

        return getattr(torch, self.dtype)

    def kv_spec(self, block_size: int) -> KVSpec:
        """The KVCache layout this model writes: one K and one V per layer, token and head."""
        return KVSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, block_size=block_size, dtype=self.dtype)

    # Hugging Face config.json <-> ModelConfig
    _HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}

    def to_hf(self) -> dict[str, Any]:
        out = {self._HF_NAMES.get(k, k): v for k, v in asdict(self).items() if k != "dtype"}
        return {**out, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "torch_dtype": self.dtype, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "rope_scaling": None, "pad_token_id": None}

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, shape_only: bool = False) -> ModelConfig:
        """The shape a ``config.json``'s contents describe.

        Args:
            hf: the parsed ``config.json``.
            shape_only: read the shape alone, for arithmetic (``kvmove-bench plan``): then the
                model types of ``SHAPE_MODEL_TYPES`` and a scaled rope are accepted, which
                the engine cannot run but whose FLOPs and KV bytes are Llama's.

        Raises:
            ConfigError: a model type or rope the engine does not run (unless
                ``shape_only``), or a field out of range.

        Example:
            >>> ModelConfig.from_hf({"num_hidden_layers": 32, "hidden_size": 4096,
            ...     "num_attention_heads": 32, "num_key_value_heads": 8}).head_dim
            128
        """
        _check_model_type(hf, SHAPE_MODEL_TYPES if shape_only else ("llama",))
        hf = {k: v for k, v in hf.items() if v is not None}  # null: the default applies
        if not shape_only:
            _check_unscaled_rope(hf)
        if "rope_theta" in (rope := hf.get("rope_parameters") or {}):
            hf["rope_theta"] = rope["rope_theta"]  # transformers >= 5 keeps it in here
        inverse = {v: k for k, v in cls._HF_NAMES.items()}
        known = {f.name for f in fields(cls)}
        kwargs = {inverse.get(k, k): v for k, v in hf.items() if inverse.get(k, k) in known}
        kwargs["dtype"] = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        for f in ("bos_token_id", "eos_token_id"):
            if isinstance(kwargs.get(f), list):
                kwargs[f] = kwargs[f][0]
            if kwargs.get(f) is None:
                kwargs.pop(f, None)
        return cls(**kwargs)

    @classmethod
    def from_hf_file(cls, path: str, *, shape_only: bool = False) -> ModelConfig:
        """``from_hf`` of a ``config.json`` file, or of the one in directory ``path``.

        Raises:
            ConfigError: no such file, or not JSON, or what ``from_hf`` refuses.
        """
        return cls.from_hf(cls.read_hf_file(path), shape_only=shape_only)

    @staticmethod
    def read_hf_file(path: str) -> dict[str, Any]:
        """The parsed ``config.json`` file ``path``, or the one in directory ``path``.

        Raises:
            ConfigError: no such file, or not a JSON object.
        """
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"{path!r} has no config.json" if os.path.isdir(path)
                              else f"no such file: {path!r}")
        try:
            with open(file) as f:
                hf = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read {file!r} as a config.json: {error}") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{file!r} holds a JSON {type(hf).__name__}, not an object")
        return hf


def _check_model_type(hf: dict[str, Any], allowed: tuple[str, ...]) -> None:
    model_type = hf.get("model_type", "llama")
    if model_type not in allowed:
        what = "Llama checkpoints are" if allowed == ("llama",) else \
            f"model types {', '.join(allowed)} are"
        raise ConfigError(f"only {what} supported, got model_type {model_type!r}")


def _check_unscaled_rope(hf: dict[str, Any]) -> None:
    if hf.get("rope_scaling"):
        raise ConfigError(f"rope_scaling {hf['rope_scaling']!r} is not supported")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters {rope!r}: only the default (unscaled) rope is "
                          "supported")


# A model that runs the whole engine test suite in seconds, and one big enough on two CPU
# cores that a 2,000-token prefill takes visibly longer than a decode step.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab_size=320, hidden_size=512, intermediate_size=1536, num_layers=8,
                         num_heads=8, num_kv_heads=2, head_dim=64),
}
