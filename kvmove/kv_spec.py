"""KV-cache spec arithmetic: how many bytes a token, a block and a prompt take.

``KVSpec`` describes one model's paged KV cache (vLLM's ``KVCacheSpec``, with the layers).
It was called ``KVLayout``, which integrators read as a block's element order (NHD/HND, what
vLLM and FlashInfer call the "layout" and kvmove the *order*); the old name stays an alias.
Its numbers come from the model config:

    bytes_per_token_per_layer = 2 (K and V) * num_kv_heads * head_dim * dtype_bytes

Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, float16) gives 4,096 B per token per layer,
131,072 B per token, and 524,288,000 B for a 4,000-token prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvmove.errors import ConfigError
from kvmove.validation import require_positive_int

__all__ = ["DTYPE_BYTES", "PRESETS", "KVLayout", "KVSpec", "buffer_span"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}

# (num_layers, num_kv_heads, head_dim) from each model's Hugging Face config.json:
# num_hidden_layers, num_key_value_heads, hidden_size / num_attention_heads.
PRESETS: dict[str, tuple[int, int, int]] = {
    "llama-3.2-1b": (16, 8, 64),
    "llama-3.2-3b": (28, 8, 128),
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (80, 8, 128),
    "llama-3.1-405b": (126, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen2.5-72b": (80, 8, 128),
    "mistral-7b": (32, 8, 128),
}


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape of one model's paged KV cache.

    Args:
        num_layers: transformer layers, each with its own K and V.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA).
        head_dim: elements per head.
        dtype: element type, one of ``DTYPE_BYTES`` ("float16", "bfloat16", "float8",
            "float32").
        block_size: tokens per block, a power of two (16 as in vLLM).
        mla: one latent per token instead of K and V (DeepSeek's multi-head latent
            attention): ``num_kv_heads`` is 1 and ``head_dim`` is the latent width
            (``kv_lora_rank + qk_rope_head_dim``, 512 + 64 for DeepSeek-V3).

    Example:
        >>> layout = kvmove.KVSpec.preset("llama-3.1-8b")   # 32 layers, 8 KV heads of 128
        >>> layout.bytes_per_token                  # 2 (K, V) * 8 * 128 * 2 B * 32 layers
        131072
        >>> layout.bytes_for(4000), layout.blocks_for(4000)   # a 4,000-token prompt
        (524288000, 250)
        >>> kvmove.KVSpec(61, 1, 576, block_size=64, mla=True).bytes_per_token_per_layer
        1152
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            require_positive_int(name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.mla and self.num_kv_heads != 1:
            raise ConfigError(f"an MLA layout has one latent per token: num_kv_heads must be 1, "
                              f"got {self.num_kv_heads}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> KVSpec:
        """The layout of a known model, e.g. ``KVSpec.preset("llama-3.1-8b", dtype="float8")``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        num_layers, num_kv_heads, head_dim = PRESETS[name]
        return replace(cls(num_layers, num_kv_heads, head_dim), **overrides)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_count(self) -> int:
        """2 (K and V), or 1 for an MLA latent."""
        return 1 if self.mla else 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V (or the MLA latent) of one token in one layer."""
        return self.kv_count * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block_per_layer(self) -> int:
        """One block of one layer: the unit ``KVCache`` lays out contiguously."""
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers."""
        return self.num_layers * self.bytes_per_block_per_layer

    def bytes_for(self, num_tokens: int) -> int:
        """Exact KV bytes of ``num_tokens`` tokens (what a transfer of them moves)."""
        if num_tokens < 0:
            raise ConfigError(f"num_tokens must be >= 0, got {num_tokens}")
        return num_tokens * self.bytes_per_token

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (the last one may be partly filled)."""
        if num_tokens < 0:
            raise ConfigError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)


KVLayout = KVSpec  # the earlier name (see the module docstring)


def buffer_span(obj: Any, device: int) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous buffer that must be in ``device``'s memory (-1:
    host): a torch tensor, anything with ``__cuda_array_interface__`` (CuPy, Numba, a device
    ``KVCache``), or a writable C-contiguous host array (numpy, the buffer protocol).

    Raises:
        ConfigError: the buffer is elsewhere, not contiguous, or read-only (host).
    """
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # a torch tensor
        where = -1 if obj.device.type != "cuda" else (obj.device.index or 0)
        if where != device:
            raise ConfigError(f"the buffer is on {obj.device}, it must be on "
                              f"{_memory_name(device)}")
        if not obj.is_contiguous():
            raise ConfigError(f"the buffer must be contiguous, got strides {obj.stride()} for "
                              f"shape {tuple(obj.shape)}")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if device < 0:
            raise ConfigError("the buffer is device memory, it must be host memory")
        itemsize, shape = np.dtype(cai["typestr"]).itemsize, tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
            raise ConfigError(f"the buffer must be contiguous, got strides {tuple(strides)} "
                              f"for shape {shape}")
        return int(cai["data"][0]), int(np.prod(shape)) * itemsize
    if device >= 0:
        raise ConfigError(f"the buffer must be device memory on {_memory_name(device)} (a CUDA "
                          f"tensor), got {type(obj).__name__}")
    array = np.asarray(obj)
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ConfigError(f"the buffer must be a writable, C-contiguous array, got shape "
                          f"{array.shape} strides {array.strides} writeable "
                          f"{array.flags.writeable}")
    return int(array.ctypes.data), int(array.nbytes)


def _memory_name(device: int) -> str:
    return "the host" if device < 0 else f"cuda:{device}"


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
