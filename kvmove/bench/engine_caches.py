"""Each engine's KV tensors as the engine allocates them, wrapped as docs/engines.md says, and
the uint64 words of each block that ``kvmove-bench transfer --wrap`` fills and verifies.

The tests (``tests/helpers/engines.py``) allocate and wrap through this module too, with
torch tensors; the bench passes numpy arrays, which ``KVCache.wrap`` takes for float16 and
float32, so ``--wrap`` needs no torch.

Per layer, ``N`` blocks of ``B`` tokens, ``H`` KV heads of ``D``::

    flash       vLLM flash-attention   [2, N, B, H, D]     K plane, V plane
    flash-hnd   the same, head-major   [2, N, H, B, D]     (tests only: order "HND")
    flashinfer  vLLM FlashInfer        [N, 2, B, H, D]     one plane
    vllm-cpu    vLLM CPU backend       [N, H, B, 2D]       one plane
    sglang      k_buffer, v_buffer     [N * B, H, D] x 2   K plane, V plane (pages of B)
    mla         one latent per token   [N, B, latent]      one plane (an MLA layout)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec

__all__ = ["ENGINES", "WRAP_FORMATS", "allocate", "block_words", "layout_for_format",
           "native_words", "wrap_engine"]

# What ``kvmove-bench transfer --wrap`` takes: one per engine row of docs/engines.md.
WRAP_FORMATS = ("flash", "flashinfer", "vllm-cpu", "sglang", "mla")
ENGINES = ("flash", "flash-hnd", "flashinfer", "vllm-cpu", "sglang", "mla")
_NUMPY_DTYPES = {"float16": np.float16, "float32": np.float32}

Zeros = Callable[..., Any]  # zeros(*shape) -> a zero-filled tensor of the layout's dtype

# A layer's tensor per engine, as a function of (zeros, N, B, H, D).
_SHAPES: dict[str, Callable[..., Any]] = {
    "flash": lambda z, n, b, h, d: z(2, n, b, h, d),
    "flash-hnd": lambda z, n, b, h, d: z(2, n, h, b, d),
    "flashinfer": lambda z, n, b, h, d: z(n, 2, b, h, d),
    "vllm-cpu": lambda z, n, b, h, d: z(n, h, b, 2 * d),
    "sglang": lambda z, n, b, h, d: (z(n * b, h, d), z(n * b, h, d)),
    "mla": lambda z, n, b, h, d: z(n, b, d),
}
# vLLM hands a connector a dict of layer name -> tensor; the others come as lists.
_AS_DICT = ("flash", "flash-hnd", "flashinfer")


def layout_for_format(engine: str, layout: KVSpec) -> KVSpec:
    """``layout`` for ``engine``: an MLA engine gets one latent per token of the same bytes
    (``head_dim = 2 * num_kv_heads * head_dim``), so every format moves the same KV."""
    if engine != "mla" or layout.mla:
        return layout
    return replace(layout, num_kv_heads=1, head_dim=layout.kv_count * layout.num_kv_heads
                   * layout.head_dim, mla=True)


def allocate(engine: str, layout: KVSpec, num_blocks: int, zeros: Zeros | None = None) -> Any:
    """The engine's tensors for ``num_blocks`` blocks, zero-filled, in its own shapes.

    Args:
        zeros: ``zeros(*shape)`` in the layout's dtype (tests pass torch's); default numpy,
            whose float16 and float32 ``KVCache.wrap`` takes.

    Raises:
        ConfigError: an unknown engine, or a dtype numpy has not (bfloat16, float8).
    """
    if engine not in _SHAPES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
    zeros = zeros or _numpy_zeros(layout)
    shape = _SHAPES[engine]
    per_layer = [shape(zeros, num_blocks, layout.block_size, layout.num_kv_heads,
                       layout.head_dim) for _ in range(layout.num_layers)]
    if engine in _AS_DICT:
        return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(per_layer)}
    return per_layer


def _numpy_zeros(layout: KVSpec) -> Zeros:
    dtype = _NUMPY_DTYPES.get(layout.dtype)
    if dtype is None:
        raise ConfigError(f"numpy has no {layout.dtype}: engine tensors of this layout need "
                          f"torch (pass zeros=), got dtype {layout.dtype!r}")
    return lambda *shape: np.zeros(shape, dtype=dtype)


def wrap_engine(engine: str, tensors: Any, layout: KVSpec, pool: bool | None = None) -> KVCache:
    """The documented ``KVCache.wrap`` call of each engine (docs/engines.md)."""
    if engine in ("flash", "flash-hnd"):
        order = "HND" if engine == "flash-hnd" else "NHD"
        return KVCache.wrap(tensors, layout=layout, block_dim=1, kv_dim=0, order=order,
                            pool=pool)
    if engine == "flashinfer":
        return KVCache.wrap(tensors, layout=layout, block_dim=0, kv_dim=1, pool=pool)
    if engine == "vllm-cpu":
        return KVCache.wrap(tensors, layout=layout, block_dim=0, order="vllm-cpu", pool=pool)
    if engine == "sglang":
        return KVCache.wrap(tensors, layout=layout, block_dim=0, page_size=layout.block_size,
                            pool=pool)
    if engine == "mla":
        return KVCache.wrap(tensors, layout=layout, block_dim=0, order="mla", pool=pool)
    raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")


def block_words(engine: str, tensors: Any, num_blocks: int) -> list[list[np.ndarray]]:
    """Per layer, per plane: writable uint64 views ``[num_blocks, words]`` of numpy
    ``tensors`` from ``allocate``; a block's words, plane after plane, are its bytes.

    Every engine's tensor is block-major except flash's, whose leading dim splits it into a
    K plane and a V plane, so one reshape per tensor finds the planes.
    """
    planes_per_tensor = 2 if engine in ("flash", "flash-hnd") else 1
    layers = tensors.values() if isinstance(tensors, dict) else tensors
    words = []
    for layer in layers:
        parts = layer if isinstance(layer, tuple) else (layer,)
        words.append([plane for t in parts
                      for plane in t.view(np.uint64).reshape(planes_per_tensor, num_blocks, -1)])
    return words


def native_words(cache: KVCache) -> list[list[np.ndarray]]:
    """``block_words`` of a host ``KVCache`` kvmove allocated: one plane per layer."""
    assert cache.region is not None
    raw = np.asarray(cache.region).view(np.uint64)
    return [[plane] for plane in raw.reshape(cache.num_layers, cache.num_blocks, -1)]
