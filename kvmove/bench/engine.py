"""``kvmove-bench engine``: what the engine's Llama costs on this machine, prefill against
decode (the asymmetry that makes disaggregation worth it). No printing: the CLI formats.

``LlamaForCausalLM.forward`` runs directly against a ``KVCache`` (no scheduler), with random
weights of a ``MODEL_PRESETS`` model. Each row is the median of ``iters`` timed iterations
after one untimed warm-up:

* **prefill**: one prompt of ``prompt_tokens`` (the headline number), then
  ``prefill_batch_sizes`` prompts of ``batch_prompt_tokens`` each in one forward. A prompt
  already gives every matmul hundreds of rows, so the CPU is busy computing and more prompts
  per forward hardly raise tokens/s.
* **decode**: ``decode_steps`` steps of one new token per sequence at each of
  ``decode_batch_sizes``, every sequence with ``context_tokens`` already in the cache. A step
  reads every weight once however many sequences share it, so tokens/s grows with the batch
  until the compute catches up.

Ratios are against batch 1 measured in the same run. Prompts are random token ids from
``seed``. The decode context is one real prefill of ``context_tokens`` copied into every
sequence's own blocks: the values do not change a step's cost, and copying spares a prefill
of ``batch x context_tokens`` tokens. Torch keeps its default thread count; the report
records it.

Cache regions (block ids), so that no row overwrites another's context::

    [0, prefill_blocks)                      prefill rows (each run overwrites the last)
    [prefill_blocks, + batch * seq_blocks)   decode sequences, seq_blocks each
"""

from __future__ import annotations

import itertools
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM, ModelConfig, SeqChunk
from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.validation import require_positive_int

__all__ = ["DecodeRow", "EngineConfig", "EngineReport", "EngineRig", "PrefillRow", "run",
           "time_calls"]

logger = logging.getLogger(__name__)


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
        self.model_config.kv_layout(self.block_size)  # validates block_size
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
        return self.config.model_config.kv_layout(self.config.block_size).bytes_per_token

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


class EngineRig:
    """The model, one ``KVCache`` for every row, and forward calls ready to time.

    ``prefill(b, n)`` and ``decode(b)`` return zero-argument callables; the benchmark file
    times them with pytest-benchmark, ``run`` with ``perf_counter``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.model = LlamaForCausalLM.random(model_config, config.seed)
        layout = model_config.kv_layout(config.block_size)
        longest = max(config.prompt_tokens,
                      max(config.prefill_batch_sizes) * config.batch_prompt_tokens)
        self.prefill_blocks = layout.blocks_for(longest)
        self.seq_blocks = layout.blocks_for(config.context_tokens + config.decode_steps)
        num_decode = max(config.decode_batch_sizes) * self.seq_blocks
        self.cache = KVCache(layout, self.prefill_blocks + num_decode)
        self.kv = self.cache.torch()
        self._rng = random.Random(config.seed)
        self._context_ready = False

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self.config.model_config.vocab_size) for _ in range(n)]

    def prefill(self, batch_size: int, prompt_tokens: int) -> Callable[[], torch.Tensor]:
        """One forward of ``batch_size`` fresh prompts in the prefill region."""
        per_prompt = -(-prompt_tokens // self.config.block_size)
        seqs = [SeqChunk(self.tokens(prompt_tokens), 0,
                         list(range(i * per_prompt, (i + 1) * per_prompt)))
                for i in range(batch_size)]
        return lambda: self.model(seqs, self.kv)

    def decode(self, batch_size: int) -> Callable[[], torch.Tensor]:
        """One decode step of ``batch_size`` sequences per call; calls cycle through
        positions ``context_tokens .. context_tokens + decode_steps - 1``."""
        self._fill_context()
        steps, context = self.config.decode_steps, self.config.context_tokens
        tables = [self._decode_table(i) for i in range(batch_size)]
        tokens = [self.tokens(batch_size) for _ in range(steps)]
        chunks = [[SeqChunk([tok], context + s, table) for tok, table in zip(tokens[s], tables)]
                  for s in range(steps)]
        counter = itertools.count()
        return lambda: self.model(chunks[next(counter) % steps], self.kv)

    def _decode_table(self, seq: int) -> list[int]:
        first = self.prefill_blocks + seq * self.seq_blocks
        return list(range(first, first + self.seq_blocks))

    def _fill_context(self) -> None:
        """Prefills sequence 0's context once and copies its blocks to every other sequence."""
        if self._context_ready:
            return
        context = self.config.context_tokens
        source = self._decode_table(0)
        self.model([SeqChunk(self.tokens(context), 0, source)], self.kv)
        for seq in range(1, max(self.config.decode_batch_sizes)):
            self.kv[:, self._decode_table(seq)] = self.kv[:, source]
        self._context_ready = True


def time_calls(fn: Callable[[], Any], iters: int, calls: int = 1) -> tuple[float, ...]:
    """One untimed warm-up of ``calls`` calls, then ``iters`` timed ones: seconds per call."""
    for _ in range(calls):
        fn()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls)
    return tuple(out)


def run(config: EngineConfig) -> EngineReport:
    """Measures every row of ``config`` (see the module docstring); about 35 s by default on
    two CPU cores."""
    start = time.perf_counter()
    rig = EngineRig(config)
    prefill = PrefillRow(1, config.prompt_tokens,
                         time_calls(rig.prefill(1, config.prompt_tokens), config.iters))
    logger.info("prefill of %d tokens: %.0f tokens/s", prefill.num_tokens, prefill.tokens_per_s)
    batches = tuple(PrefillRow(b, config.batch_prompt_tokens,
                               time_calls(rig.prefill(b, config.batch_prompt_tokens), config.iters))
                    for b in config.prefill_batch_sizes)
    decode = tuple(DecodeRow(b, config.context_tokens, config.decode_steps,
                             time_calls(rig.decode(b), config.iters, config.decode_steps))
                   for b in config.decode_batch_sizes)
    return EngineReport(
        config=config, num_params=sum(p.numel() for p in rig.model.parameters()),
        num_threads=torch.get_num_threads(), torch_version=torch.__version__,
        prefill=prefill, prefill_batches=batches, decode=decode,
        wall_seconds=time.perf_counter() - start)
