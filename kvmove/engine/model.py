"""A Llama-architecture transformer whose KV cache lives in a ``kvmove.KVCache``.

RMSNorm, rotary embeddings (Llama's rotate-half convention, no scaling), grouped-query
attention (``num_kv_heads`` divides ``num_heads``), a SwiGLU MLP, tied or untied embeddings.
Module names follow Hugging Face's ``LlamaForCausalLM``, so a checkpoint's state dict loads
as it is (``model.layers.3.self_attn.q_proj.weight`` ...).

The forward pass is varlen, as in vLLM: the new tokens of every sequence in the batch are
flattened into one ``[T, hidden]`` tensor for the matmuls; attention runs per sequence over
the keys its block table holds. Each layer first writes its new K and V into the cache (a
zero-copy torch view of the KVCache, ``[L, N, 2, B, H, D]``, kvmove's documented order), then
reads the sequence's whole context back through the block table (paged attention written in
torch, with ``scaled_dot_product_attention``), then calls ``layer_hook(layer)``: the
disaggregated prefill worker's hook is ``save_layer``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvmove.engine.config import MODEL_PRESETS, ModelConfig
from kvmove.errors import ConfigError

__all__ = ["MODEL_PRESETS", "LlamaForCausalLM", "ModelConfig", "SeqChunk"]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's part of a forward pass: ``tokens`` at positions ``start ...`` (the cache
    already holds positions ``[0, start)``), with ``block_table`` covering every position up
    to ``start + len(tokens)``."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class _Plan:
    """Index tensors one forward pass needs, built once: positions, where each new token's K/V
    goes in the cache, and each sequence's slice of the flattened tokens."""

    def __init__(self, seqs: Sequence[SeqChunk], block_size: int, num_blocks: int,
                 max_positions: int) -> None:
        positions, blocks, offsets, self.spans = [], [], [], []
        self.tables: list[torch.Tensor] = []
        self.context: list[int] = []
        first = 0
        for i, seq in enumerate(seqs):
            n, end = len(seq.tokens), seq.start + len(seq.tokens)
            if n == 0:
                raise ConfigError(f"sequence {i} has no new tokens")
            if seq.start < 0 or end > max_positions:
                raise ConfigError(f"sequence {i} covers positions [{seq.start}, {end}), the "
                                  f"model has {max_positions}")
            needed = -(-end // block_size)
            if len(seq.block_table) < needed:
                raise ConfigError(f"sequence {i} needs {needed} blocks for {end} positions, "
                                  f"its block table has {len(seq.block_table)}")
            table = torch.as_tensor(list(seq.block_table[:needed]), dtype=torch.long)
            if needed and (int(table.min()) < 0 or int(table.max()) >= num_blocks):
                raise ConfigError(f"sequence {i}'s block table has ids outside [0, {num_blocks})")
            pos = torch.arange(seq.start, end)
            positions.append(pos)
            blocks.append(table[pos // block_size])
            offsets.append(pos % block_size)
            self.tables.append(table)
            self.context.append(end)
            self.spans.append((first, first + n, seq.start))
            first += n
        self.positions = torch.cat(positions)
        self.blocks = torch.cat(blocks)
        self.offsets = torch.cat(offsets)
        self.last = torch.tensor([stop - 1 for _, stop, _ in self.spans])


class LlamaForCausalLM(nn.Module):
    """The model. Build with ``random(config, seed)`` or ``from_pretrained(path)``."""

    inv_freq: torch.Tensor  # a buffer (register_buffer): nn.Module types it Tensor | Module

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        half = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
        self.register_buffer("inv_freq", (1.0 / config.rope_theta ** half).float(),
                             persistent=False)

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
        """Weights drawn with a fixed seed (normal, std 0.02; norms 1): no downloads, ever."""
        model = cls(config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        return model.to(config.torch_dtype).eval()

    @classmethod
    def from_pretrained(cls, path: str) -> LlamaForCausalLM:
        """A local Hugging Face Llama directory: ``config.json`` and ``*.safetensors``."""
        from safetensors.torch import load_file

        if not os.path.isdir(path):
            raise ConfigError(f"{path!r} is not a checkpoint directory")
        config = ModelConfig.from_hf_file(path)
        shards = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        if not shards:
            raise ConfigError(f"{path!r} has no *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(path, shard)))
        model = cls(config)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        ours = model.state_dict()
        wrong = [f"{k}: {tuple(v.shape)} in the file, {tuple(ours[k].shape)} for the config"
                 for k, v in state.items() if k in ours and v.shape != ours[k].shape]
        if wrong:
            raise ConfigError(f"{path!r} does not match its config: {wrong[:3]}")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ConfigError(f"{path!r} does not match the config: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
        return model.to(config.torch_dtype).eval()

    def save_pretrained(self, path: str) -> None:
        """Writes ``config.json`` and ``model.safetensors`` (Hugging Face names)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config.to_hf(), f, indent=2)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    # --- forward --------------------------------------------------------------------------

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[T, heads, D]`` at ``positions`` ``[T]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqChunk], kv: torch.Tensor,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Computes ``seqs``' new tokens, writing their K/V into ``kv``; returns the logits of
        each sequence's last new token, ``[len(seqs), vocab_size]`` (float32).

        ``kv`` is ``KVCache.torch()``: ``[num_layers, num_blocks, 2, block_size, kv heads,
        head_dim]`` in the model's dtype. ``layer_hook(i)`` runs once layer ``i``'s K/V for
        every sequence are in the cache.
        """
        c = self.config
        if kv.dim() != 6 or kv.shape[0] != c.num_layers or kv.shape[2] != 2 or \
                kv.shape[4] != c.num_kv_heads or kv.shape[5] != c.head_dim or \
                kv.dtype != c.torch_dtype:
            raise ConfigError(f"kv cache of shape {tuple(kv.shape)} ({kv.dtype}) does not fit "
                              f"the model: want [{c.num_layers}, N, 2, B, {c.num_kv_heads}, "
                              f"{c.head_dim}] in {c.dtype}")
        if not seqs:
            raise ConfigError("forward needs at least one sequence")
        block_size = kv.shape[3]
        plan = _Plan(seqs, block_size, kv.shape[1], c.max_position_embeddings)
        tokens = torch.as_tensor([t for seq in seqs for t in seq.tokens], dtype=torch.long)
        if int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab_size:
            raise ConfigError(f"token ids must be in [0, {c.vocab_size})")
        hidden = self.model.embed_tokens(tokens)
        # ModuleList yields Module; these are the DecoderLayers LlamaModel made
        for index, layer in enumerate(cast("list[DecoderLayer]", self.model.layers)):
            hidden = hidden + self._attention(layer, layer.input_layernorm(hidden), kv[index],
                                              plan)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if layer_hook is not None:
                layer_hook(index)
        last = self.model.norm(hidden[plan.last])
        return self.lm_head(last).float()

    def _attention(self, layer: DecoderLayer, x: torch.Tensor, kv: torch.Tensor,
                   plan: _Plan) -> torch.Tensor:
        attn, T = layer.self_attn, x.shape[0]
        q = attn.q_proj(x).view(T, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(T, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(T, attn.num_kv_heads, attn.head_dim)
        q, k = self._rotate(q, plan.positions), self._rotate(k, plan.positions)
        kv[plan.blocks, 0, plan.offsets] = k  # this layer's K/V into the paged cache
        kv[plan.blocks, 1, plan.offsets] = v
        out = torch.empty_like(q)
        groups = attn.num_heads // attn.num_kv_heads
        for (first, stop, start), table, context in zip(plan.spans, plan.tables, plan.context):
            keys = kv[table, 0].reshape(-1, attn.num_kv_heads, attn.head_dim)[:context]
            values = kv[table, 1].reshape(-1, attn.num_kv_heads, attn.head_dim)[:context]
            n = stop - first
            # query j (position start + j) sees keys 0 .. start + j: a whole prompt is plain
            # causal, one new token sees everything, a later chunk needs the mask
            mask = None
            if 1 < n < context:
                mask = torch.arange(context)[None, :] <= torch.arange(start, start + n)[:, None]
            out[first:stop] = F.scaled_dot_product_attention(
                q[first:stop].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, is_causal=n == context and n > 1,
                scale=1.0 / math.sqrt(attn.head_dim), enable_gqa=groups > 1,
            ).transpose(0, 1)
        return attn.o_proj(out.reshape(T, -1))


def with_overrides(config: ModelConfig, **overrides: Any) -> ModelConfig:
    """``config`` with fields replaced (validated again)."""
    return replace(config, **overrides)
