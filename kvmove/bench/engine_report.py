"""``kvmove-bench engine``'s configuration (``EngineConfig``), its rows and report, as plain
data (``to_dict``, in ``--json``) and as text (``format_engine``). ``engine.py`` says what is
measured and how; ``engine_rig`` measures it. Like ``engine.py``, this needs no torch."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from kvmove.bench.report import aligned, ms
from kvmove.engine.config import MODEL_PRESETS, ModelConfig
from kvmove.errors import ConfigError
from kvmove.validation import require_positive_int

__all__ = ["DecodeRow", "EngineConfig", "EngineReport", "PrefillRow", "count_steps",
           "format_engine"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What ``run`` measures.

    Args:
        model: a ``MODEL_PRESETS`` name.
        prompt_tokens: the headline prefill's prompt length.
        decode_batch_sizes: sequences per decode step, one row each; must include 1 (the
            baseline).
        decode_steps: timed steps per decode iteration (positions ``context_tokens ...``).
        context_tokens: tokens each decoding sequence already has in the cache.
        prefill_batch_sizes: prompts per prefill forward, one row each; must include 1.
        batch_prompt_tokens: each prompt's length in those rows.
        iters: timed iterations per row, after one warm-up; rows report the median.
        seed: weights and prompt tokens.
        block_size: tokens per KV block.
    """

    model: str = "small"
    prompt_tokens: int = 2000
    decode_batch_sizes: tuple[int, ...] = (1, 4, 16)
    decode_steps: int = 16
    context_tokens: int = 512
    prefill_batch_sizes: tuple[int, ...] = (1, 4)
    batch_prompt_tokens: int = 512
    iters: int = 5
    seed: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.model not in MODEL_PRESETS:
            raise ConfigError(f"unknown model preset {self.model!r}; known: "
                              f"{', '.join(MODEL_PRESETS)}")
        for name in ("prompt_tokens", "decode_steps", "context_tokens", "batch_prompt_tokens",
                     "iters"):
            require_positive_int(name, getattr(self, name))
        for name in ("decode_batch_sizes", "prefill_batch_sizes"):
            sizes = getattr(self, name)
            if isinstance(sizes, list):  # as argparse's nargs gives them
                object.__setattr__(self, name, sizes := tuple(sizes))
            _check_batch_sizes(name, sizes)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        self.model_config.kv_spec(self.block_size)  # validates block_size
        limit = self.model_config.max_position_embeddings
        for name, positions in (("prompt_tokens", self.prompt_tokens),
                                ("batch_prompt_tokens", self.batch_prompt_tokens),
                                ("context_tokens + decode_steps",
                                 self.context_tokens + self.decode_steps)):
            if positions > limit:
                raise ConfigError(f"{name} = {positions} exceeds {self.model}'s "
                                  f"max_position_embeddings {limit}")

    @property
    def model_config(self) -> ModelConfig:
        return MODEL_PRESETS[self.model]


def count_steps(config: EngineConfig) -> int:
    """How many times ``engine_rig.run`` calls ``progress``: one per row."""
    return 1 + len(config.prefill_batch_sizes) + len(config.decode_batch_sizes)


def _check_batch_sizes(name: str, sizes: tuple[int, ...]) -> None:
    if not isinstance(sizes, tuple) or not sizes:
        raise ConfigError(f"{name} must be a non-empty tuple of batch sizes, got {sizes!r}")
    for size in sizes:
        require_positive_int(name, size)
    if 1 not in sizes:
        raise ConfigError(f"{name} must include 1 (the baseline), got {sizes}")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"{name} must not repeat a batch size, got {sizes}")


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """``batch_size`` prompts of ``prompt_tokens`` in one forward; ``seconds`` per forward."""

    batch_size: int
    prompt_tokens: int
    seconds: tuple[float, ...]

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.prompt_tokens

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.median_seconds

    @property
    def ms_per_token(self) -> float:
        return self.median_seconds / self.num_tokens * 1e3

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "num_tokens": self.num_tokens,
                "median_seconds": self.median_seconds, "tokens_per_s": self.tokens_per_s,
                "ms_per_token": self.ms_per_token}


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """``batch_size`` sequences, one token each per step; ``seconds`` holds each iteration's
    mean step time (``steps`` steps, from ``context_tokens`` on)."""

    batch_size: int
    context_tokens: int
    steps: int
    seconds: tuple[float, ...]

    @property
    def step_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.step_seconds

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_seconds": self.step_seconds,
                "tokens_per_s": self.tokens_per_s}


@dataclass(frozen=True, slots=True)
class EngineReport:
    """Everything one ``run`` measured; ``to_dict`` is ``kvmove-bench engine --json``."""

    config: EngineConfig
    num_params: int
    num_threads: int
    torch_version: str
    prefill: PrefillRow
    prefill_batches: tuple[PrefillRow, ...]
    decode: tuple[DecodeRow, ...]
    wall_seconds: float

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.model_config.kv_spec(self.config.block_size).bytes_per_token

    def prefill_ratio(self, row: PrefillRow) -> float:
        """``row``'s tokens/s over the one-prompt batch row's (same prompt length)."""
        base = next(r for r in self.prefill_batches if r.batch_size == 1)
        return row.tokens_per_s / base.tokens_per_s

    def decode_ratio(self, row: DecodeRow) -> float:
        """``row``'s tokens/s over batch 1's."""
        return row.tokens_per_s / self._decode_base.tokens_per_s

    def step_time_ratio(self, row: DecodeRow) -> float:
        """``row``'s step time over batch 1's (what the batch costs each sequence in latency)."""
        return row.step_seconds / self._decode_base.step_seconds

    @property
    def prefill_over_decode(self) -> float:
        """Headline prefill tokens/s over batch-1 decode tokens/s."""
        return self.prefill.tokens_per_s / self._decode_base.tokens_per_s

    @property
    def _decode_base(self) -> DecodeRow:
        return next(r for r in self.decode if r.batch_size == 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config), "model": asdict(self.config.model_config),
            "statistic": f"median of {self.config.iters} iterations after 1 warm-up",
            "num_params": self.num_params, "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_threads": self.num_threads, "torch_version": self.torch_version,
            "prefill": self.prefill.to_dict(),
            "prefill_batches": [{**r.to_dict(), "tokens_per_s_vs_batch_1":
                                 self.prefill_ratio(r)} for r in self.prefill_batches],
            "decode": [{**r.to_dict(), "tokens_per_s_vs_batch_1": self.decode_ratio(r),
                        "step_time_vs_batch_1": self.step_time_ratio(r)} for r in self.decode],
            "prefill_over_decode": self.prefill_over_decode,
            "wall_seconds": self.wall_seconds,
        }


# --- text -----------------------------------------------------------------------------------

def format_engine(report: EngineReport) -> str:
    """Header, the prefill table, the decode table, and the asymmetry in two lines."""
    return "\n".join([_header(report), "", *_prefill_table(report), "", *_decode_table(report),
                      "", *_asymmetry_lines(report), "",
                      f"measured in {report.wall_seconds:.1f} s"])


def _header(report: EngineReport) -> str:
    config, model = report.config, report.config.model_config
    return (f"{config.model} Llama ({model.num_layers} layers, hidden {model.hidden_size}, "
            f"{model.num_heads} heads / {model.num_kv_heads} KV heads, head_dim "
            f"{model.head_dim}, {model.dtype}, {report.num_params / 1e6:.1f} M parameters, "
            f"random weights), KV {report.kv_bytes_per_token:,} B per token in blocks of "
            f"{config.block_size}; LlamaForCausalLM.forward on the CPU, torch "
            f"{report.torch_version} with {report.num_threads} threads; median of "
            f"{config.iters} iterations after a warm-up")


def _prefill_table(report: EngineReport) -> list[str]:
    head = ["prefill", "prompts", "tokens each", "ms", "ms/token", "tokens/s", "vs 1 prompt"]
    rows = [_prefill_cells("one prompt", report.prefill, "")]
    rows += [_prefill_cells("batched" if row.batch_size > 1 else "baseline", row,
                            f"{report.prefill_ratio(row):.2f}x")
             for row in report.prefill_batches]
    return aligned(head, rows, left={0})


def _prefill_cells(label: str, row: PrefillRow, ratio: str) -> list[str]:
    return [label, str(row.batch_size), f"{row.prompt_tokens:,}", ms(row.median_seconds * 1e3),
            f"{row.ms_per_token:.3f}", f"{row.tokens_per_s:,.0f}", ratio]


def _decode_table(report: EngineReport) -> list[str]:
    config = report.config
    head = [f"decode ({config.context_tokens:,} tokens of context, {config.decode_steps} steps)",
            "batch", "step ms", "tokens/s", "tokens/s vs batch 1", "step time vs batch 1"]
    rows = [["", str(row.batch_size), ms(row.step_seconds * 1e3), f"{row.tokens_per_s:,.1f}",
             f"{report.decode_ratio(row):.2f}x", f"{report.step_time_ratio(row):.2f}x"]
            for row in report.decode]
    return aligned(head, rows, left={0})


def _asymmetry_lines(report: EngineReport) -> list[str]:
    decode = max(report.decode, key=lambda row: row.batch_size)
    prefill = max(report.prefill_batches, key=lambda row: row.batch_size)
    return [
        f"asymmetry: batching {decode.batch_size} sequences multiplies decode throughput by "
        f"{report.decode_ratio(decode):.2f} (each step takes {report.step_time_ratio(decode):.2f}x"
        f" as long); batching {prefill.batch_size} prompts multiplies prefill's by "
        f"{report.prefill_ratio(prefill):.2f}",
        f"a {report.prefill.prompt_tokens:,}-token prefill runs {report.prefill.tokens_per_s:,.0f}"
        f" tokens/s, {report.prefill_over_decode:.0f}x decode's at batch 1",
    ]
