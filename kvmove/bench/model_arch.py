"""What a Llama-shaped ``ModelConfig`` does not say about the models P/D is most used for:
multi-head latent attention (MLA: DeepSeek-V2/V3) and mixture-of-experts MLPs (DeepSeek,
Mixtral, Qwen3-MoE), read from their ``config.json`` for ``kvmove-bench plan``.

What each changes in the plan:

* **MLA** caches one latent per token and layer instead of K and V per KV head:
  ``kv_lora_rank + qk_rope_head_dim`` elements (DeepSeek-V3: 512 + 64 = 576, 1,152 bytes in
  bf16, where its 128 heads of K and V would take 80 KiB). Its matmuls per token and layer:
  the query (through ``q_lora_rank`` when set), the latent's down projection
  ``hidden x (kv_lora_rank + rope)``, its up projection ``kv_lora_rank x heads x (nope + v)``
  and the output ``heads x v x hidden``; attention runs over ``nope + rope`` (QK) and ``v``
  (PV) dimensions per head (the prefill computes K and V from the latent, as vLLM's MLA
  prefill does).
* **MoE** multiplies each token by the experts it is routed to, not all of them: per MoE
  layer ``3 x hidden x expert_intermediate x (active + shared)`` plus the router
  ``hidden x experts``; the first ``dense_layers`` layers keep a dense MLP of
  ``intermediate_size``. The FLOPs are the active parameters'; the KV is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmove.engine.config import ModelConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["ARCH_MODEL_TYPES", "DENSE", "Arch", "Mla", "Moe", "from_hf"]


@dataclass(frozen=True, slots=True)
class Mla:
    """Multi-head latent attention's dimensions (DeepSeek's config.json names)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0   # 0: the query is projected from the hidden state directly

    @property
    def latent(self) -> int:
        """Elements cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def params_per_layer(self, hidden: int, heads: int) -> int:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        query = (hidden * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank
                 else hidden * heads * qk)
        return (query + hidden * self.latent
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
                + heads * self.v_head_dim * hidden)


@dataclass(frozen=True, slots=True)
class Moe:
    """A mixture-of-experts MLP: ``active`` of ``experts`` routed experts per token, and
    ``shared`` experts every token uses, each of ``expert_intermediate``; the first
    ``dense_layers`` layers are dense."""

    experts: int
    active: int
    expert_intermediate: int
    shared: int = 0
    dense_layers: int = 0

    def mlp_params(self, shape: ModelConfig) -> int:
        """The MLP weights one token multiplies, all layers together."""
        dense = 3 * shape.hidden_size * shape.intermediate_size
        routed = (3 * shape.hidden_size * self.expert_intermediate * (self.active + self.shared)
                  + shape.hidden_size * self.experts)
        return self.dense_layers * dense + (shape.num_layers - self.dense_layers) * routed


@dataclass(frozen=True, slots=True)
class Arch:
    """A model's MLA and MoE parts; neither: a dense Llama-shaped model (``DENSE``)."""

    mla: Mla | None = None
    moe: Moe | None = None

    def kv_spec(self, shape: ModelConfig, block_size: int) -> KVSpec:
        if self.mla is None:
            return shape.kv_spec(block_size)
        return KVSpec(num_layers=shape.num_layers, num_kv_heads=1, head_dim=self.mla.latent,
                      dtype=shape.dtype, block_size=block_size, mla=True)

    def describe(self) -> str:
        """Empty for a dense model, else e.g. "MLA latent 576 per token and layer; MoE 8 of 256
        experts + 1 shared active"."""
        parts = []
        if self.mla is not None:
            parts.append(f"MLA latent {self.mla.latent} per token and layer")
        if self.moe is not None:
            shared = f" + {self.moe.shared} shared" if self.moe.shared else ""
            parts.append(f"MoE {self.moe.active} of {self.moe.experts} experts{shared} active")
        return "; ".join(parts)


DENSE = Arch()

# config.json model_type -> how its MLA and MoE fields are named
ARCH_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe")


def from_hf(hf: dict[str, Any]) -> tuple[ModelConfig, Arch]:
    """The Llama-shaped part and the ``Arch`` of a ``config.json`` of ``ARCH_MODEL_TYPES``.

    Raises:
        ConfigError: another model type, or a field missing or not a positive int.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCH_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not one of {ARCH_MODEL_TYPES}")
    if model_type.startswith("deepseek"):
        mla = Mla(_field(hf, "kv_lora_rank"), _field(hf, "qk_rope_head_dim"),
                  _field(hf, "qk_nope_head_dim"), _field(hf, "v_head_dim"),
                  _field(hf, "q_lora_rank", 0))
        moe = Moe(_field(hf, "n_routed_experts"), _field(hf, "num_experts_per_tok"),
                  _field(hf, "moe_intermediate_size"), _field(hf, "n_shared_experts", 0),
                  _field(hf, "first_k_dense_replace", 0))
        heads = _field(hf, "num_attention_heads")
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        return _base(hf, num_kv_heads=heads, head_dim=head_dim), Arch(mla, moe)
    if model_type == "mixtral":   # intermediate_size is each expert's
        expert = _field(hf, "intermediate_size")
        moe = Moe(_field(hf, "num_local_experts"), _field(hf, "num_experts_per_tok"), expert)
    else:   # qwen3_moe: every layer sparse (its default decoder_sparse_step 1), no shared one
        moe = Moe(_field(hf, "num_experts"), _field(hf, "num_experts_per_tok"),
                  _field(hf, "moe_intermediate_size"))
    return _base(hf), Arch(moe=moe)


def _base(hf: dict[str, Any], num_kv_heads: int | None = None,
          head_dim: int | None = None) -> ModelConfig:
    """The Llama-shaped fields (layers, width, heads, vocabulary, dtype)."""
    heads = _field(hf, "num_attention_heads")
    hidden = _field(hf, "hidden_size")
    return ModelConfig(
        vocab_size=_field(hf, "vocab_size"), hidden_size=hidden,
        intermediate_size=_field(hf, "intermediate_size"),
        num_layers=_field(hf, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=num_kv_heads or _field(hf, "num_key_value_heads", heads),
        head_dim=head_dim or _field(hf, "head_dim", hidden // heads),
        dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
        bos_token_id=0, eos_token_id=0)


def _field(hf: dict[str, Any], name: str, default: int | None = None) -> int:
    value = hf.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"config.json of model_type {hf.get('model_type')!r} has no "
                              f"{name!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json's {name!r} must be a non-negative int, got {value!r}")
    return value
