"""How long a prompt's prefill takes, for the planner: counted FLOPs over an accelerator's
throughput, unless the user gives the time.

FLOPs of one prefill of T tokens (one sequence, causal mask; a multiply-add counts 2)::

    weights    2 * P * T                   P = matmul_params: each layer's q, k, v, o
                                           projections and the SwiGLU MLP's three matrices
    LM head    2 * hidden * vocab          once: a prefill samples only its last token
    attention  L * 2 * heads * head_dim * T * (T + 1)
                                           QK^T and PV over the causal pairs: query i sees
                                           i + 1 keys, T(T+1)/2 pairs of head_dim MACs each

Left out: the embedding (a lookup) and the norms, rotary and softmax (a few operations per
element, where the matmuls do 2 x hidden or 2 x head_dim). Llama-3.1-8B, 4,000 tokens:
P = 6.98e9, weights 5.58e13, attention 4.20e12, in all 6.0e13 FLOPs.

The time is ``FLOPs / (tp * peak * utilisation)``: tensor parallelism splits the FLOPs
evenly and its all-reduces are not counted, so with tp > 1 it is a lower bound. Or, from a
``kvmove-bench engine --json`` report, the FLOP rate this machine's reference engine reached
on its own prefill, applied to this model's FLOPs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmove.bench.model_arch import DENSE, Arch
from kvmove.engine.config import ModelConfig
from kvmove.errors import ConfigError
from kvmove.validation import require_positive_finite, require_positive_int

__all__ = ["ACCELERATORS", "DEFAULT_GPU", "DEFAULT_UTILIZATION", "Accelerator",
           "PrefillEstimate", "PrefillFlops", "from_engine_report", "given", "matmul_params",
           "on_accelerator", "parse_accelerator", "prefill_flops"]


@dataclass(frozen=True, slots=True)
class Accelerator:
    """A GPU by its published dense (no sparsity) bf16 tensor-core peak, in TFLOP/s."""

    name: str
    dense_bf16_tflops: float

    def __post_init__(self) -> None:
        require_positive_finite(f"TFLOP/s of {self.name!r}", self.dense_bf16_tflops)


# NVIDIA's datasheets print bf16 "with sparsity"; the dense peak is half of it: H100 and H200
# SXM 1,979 -> 989.5, B200 4.5 P -> 2,250; A100 SXM prints 312 dense.
ACCELERATORS: dict[str, Accelerator] = {
    "a100": Accelerator("A100 SXM", 312.0),
    "h100": Accelerator("H100 SXM", 989.5),
    "h200": Accelerator("H200 SXM", 989.5),
    "b200": Accelerator("B200", 2250.0),
}
DEFAULT_GPU = "h100"
# An assumption, not a measurement: the share of the peak a long prefill keeps busy. The
# output prints it beside the estimate, and --utilization changes it.
DEFAULT_UTILIZATION = 0.4


def parse_accelerator(text: str) -> Accelerator:
    """``"h100"`` (a name of ``ACCELERATORS``) or ``"NAME=TFLOPS"`` (e.g. ``"MI300X=1307"``)."""
    if text.lower() in ACCELERATORS:
        return ACCELERATORS[text.lower()]
    name, sep, tflops = text.rpartition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--gpu must be one of {', '.join(ACCELERATORS)} or NAME=TFLOPS, "
                          f"got {text!r}")
    try:
        return Accelerator(name.strip(), float(tflops))
    except ValueError:
        raise ConfigError(f"--gpu {text!r}: the dense bf16 peak must be a number of TFLOP/s, "
                          f"got {tflops!r}") from None


def matmul_params(shape: ModelConfig, arch: Arch = DENSE) -> int:
    """Weights every token multiplies: per layer q, o (heads x head_dim), k, v (KV heads x
    head_dim) and the MLP's gate, up and down; times the layers. MLA and MoE as
    ``kvmove.bench.model_arch`` says (an MoE token: its active experts only)."""
    hidden = shape.hidden_size
    if arch.mla is not None:
        attention = arch.mla.params_per_layer(hidden, shape.num_heads)
    else:
        attention = 2 * hidden * (shape.num_heads + shape.num_kv_heads) * shape.head_dim
    mlp = (arch.moe.mlp_params(shape) if arch.moe is not None
           else shape.num_layers * 3 * hidden * shape.intermediate_size)
    return shape.num_layers * attention + mlp


@dataclass(frozen=True, slots=True)
class PrefillFlops:
    """The three terms of the module docstring, in FLOPs."""

    weights: float
    lm_head: float
    attention: float

    @property
    def total(self) -> float:
        return self.weights + self.lm_head + self.attention


def prefill_flops(shape: ModelConfig, num_tokens: int, arch: Arch = DENSE) -> PrefillFlops:
    """FLOPs of one ``num_tokens``-token prefill of ``shape`` (the module docstring)."""
    require_positive_int("num_tokens", num_tokens)
    pairs_x2 = num_tokens * (num_tokens + 1)
    # QK^T and PV dimensions per head (MLA: nope + rope, and v)
    qk_pv = (2 * shape.head_dim if arch.mla is None else
             arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim + arch.mla.v_head_dim)
    return PrefillFlops(
        weights=2.0 * matmul_params(shape, arch) * num_tokens,
        lm_head=2.0 * shape.hidden_size * shape.vocab_size,
        attention=float(shape.num_layers * shape.num_heads * qk_pv * pairs_x2))


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """A prefill time and where it came from.

    ``source``: "given" (``--prefill-ms``), "flops" (counted FLOPs on an accelerator) or
    "engine" (this machine's measured engine rate); ``basis`` says it in words.
    """

    ms: float
    source: str
    basis: str
    details: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"ms": self.ms, "source": self.source, "basis": self.basis, **self.details}


def given(ms: float) -> PrefillEstimate:
    """A prefill time the user measured or chose."""
    require_positive_finite("prefill_ms", ms)
    return PrefillEstimate(float(ms), "given", "given", {})


def on_accelerator(shape: ModelConfig, num_tokens: int, gpu: Accelerator, tp: int = 1,
                   utilization: float = DEFAULT_UTILIZATION,
                   arch: Arch = DENSE) -> PrefillEstimate:
    """FLOPs over ``tp`` GPUs' peak times ``utilization`` (0 < utilization <= 1)."""
    require_positive_int("tp", tp)
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization!r}")
    flops = prefill_flops(shape, num_tokens, arch)
    rate = tp * gpu.dense_bf16_tflops * 1e12 * utilization
    basis = (f"estimated: {flops.total:.3g} FLOPs on {tp} x {gpu.name} at "
             f"{gpu.dense_bf16_tflops:g} TFLOP/s dense bf16 peak, "
             f"{utilization:.0%} utilisation assumed")
    return PrefillEstimate(flops.total / rate * 1e3, "flops", basis, {
        "flops": flops.total, "weights_flops": flops.weights, "lm_head_flops": flops.lm_head,
        "attention_flops": flops.attention, "gpu": gpu.name,
        "peak_tflops": gpu.dense_bf16_tflops, "tp": tp, "utilization": utilization})


def from_engine_report(shape: ModelConfig, num_tokens: int, path: str,
                       arch: Arch = DENSE) -> PrefillEstimate:
    """This model's FLOPs at the FLOP rate of the reference engine's measured prefill in a
    ``kvmove-bench engine --json`` report (``path``).

    Raises:
        ConfigError: the file is not such a report.
    """
    engine_shape, engine_tokens, seconds = _read_engine_report(path)
    rate = prefill_flops(engine_shape, engine_tokens).total / seconds
    flops = prefill_flops(shape, num_tokens, arch).total
    basis = (f"this machine's engine prefill ({engine_tokens:,} tokens in {seconds * 1e3:,.0f} "
             f"ms = {rate / 1e12:.3g} TFLOP/s achieved, {path}), scaled by FLOPs: "
             f"{flops:.3g} FLOPs")
    return PrefillEstimate(flops / rate * 1e3, "engine", basis, {
        "flops": flops, "engine_report": path, "engine_prompt_tokens": engine_tokens,
        "engine_seconds": seconds, "achieved_tflops": rate / 1e12})


def _read_engine_report(path: str) -> tuple[ModelConfig, int, float]:
    """(engine model shape, prompt tokens, median seconds) of a report's headline prefill."""
    try:
        with open(path) as f:
            report = json.load(f)
        prefill = report["prefill"]
        shape = ModelConfig(**report["model"])
        tokens, seconds = int(prefill["prompt_tokens"]), float(prefill["median_seconds"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--engine-report {path!r} is not a `kvmove-bench engine --json` "
                          f"report: {error!r}") from None
    require_positive_finite("the engine report's median_seconds", seconds)
    return shape, tokens, seconds
