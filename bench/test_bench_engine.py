"""The engine's "small" Llama on this machine's CPU: a 2,000-token prefill against decode steps
at batch 1, 4 and 16, each sequence with 512 tokens of context in the cache.

Run: ``pytest bench/test_bench_engine.py`` (add ``--benchmark-json out.json`` for a file);
``kvmove-bench engine`` measures the same rows as one report. ``LlamaForCausalLM.forward``
runs directly against a ``KVCache`` (``kvmove.bench.engine_rig.EngineRig``), random weights,
torch's default thread count. One group per kind of row:

* ``test_prefill``: one forward of one 2,000-token prompt. ``extra_info``: tokens/s and
  ms per token.
* ``test_prefill_batch``: 1 and 4 prompts of 512 tokens in one forward. ``extra_info``:
  tokens/s and its ratio to one prompt: prefill hardly gains from batching.
* ``test_decode_step``: one decode step (one new token per sequence) at batch 1, 4, 16.
  ``extra_info``: tokens/s, and tokens/s and step time as ratios to batch 1: decode
  throughput grows with the batch.

Baselines (batch 1) are this run's: the batch-1 row's median when it ran first, otherwise
measured in the fixture (``-k`` deselecting it). No row asserts a speed.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from kvmove.bench.engine_report import EngineConfig
from kvmove.bench.engine_rig import EngineRig, time_calls

CONFIG = EngineConfig()
PREFILL_ROUNDS = 5
DECODE_ROUNDS = 5 * CONFIG.decode_steps  # five passes over the decode positions


class Baselines:
    """Batch-1 medians (seconds per call), by row kind."""

    def __init__(self, rig: EngineRig) -> None:
        self.rig = rig
        self.seconds: dict[str, float] = {}

    def get(self, kind: str) -> float:
        if kind not in self.seconds:
            fn, rounds, calls = self._batch_1(kind)
            self.seconds[kind] = statistics.median(time_calls(fn, rounds, calls))
        return self.seconds[kind]

    def _batch_1(self, kind: str) -> tuple[Any, int, int]:
        if kind == "prefill_batch":
            return self.rig.prefill(1, CONFIG.batch_prompt_tokens), PREFILL_ROUNDS, 1
        return self.rig.decode(1), 5, CONFIG.decode_steps


@pytest.fixture(scope="module")
def rig() -> EngineRig:
    return EngineRig(CONFIG)


@pytest.fixture(scope="module")
def baselines(rig: EngineRig) -> Baselines:
    return Baselines(rig)


def _median(benchmark: Any) -> float | None:
    """The row's median seconds, or None under ``--benchmark-disable``."""
    return benchmark.stats.stats.median if benchmark.stats is not None else None


def test_prefill(benchmark, rig):
    benchmark.group = f"engine {CONFIG.model}: prefill of one {CONFIG.prompt_tokens}-token prompt"
    benchmark.pedantic(rig.prefill(1, CONFIG.prompt_tokens), rounds=PREFILL_ROUNDS,
                       warmup_rounds=1, iterations=1)
    median = _median(benchmark)
    if median is not None:
        benchmark.extra_info.update({"tokens": CONFIG.prompt_tokens,
                                     "tokens_per_s": CONFIG.prompt_tokens / median,
                                     "ms_per_token": median / CONFIG.prompt_tokens * 1e3})


@pytest.mark.parametrize("batch_size", CONFIG.prefill_batch_sizes,
                         ids=[f"batch-{b}" for b in CONFIG.prefill_batch_sizes])
def test_prefill_batch(benchmark, rig, baselines, batch_size):
    n = CONFIG.batch_prompt_tokens
    benchmark.group = f"engine {CONFIG.model}: prefill of {n}-token prompts, batched"
    benchmark.pedantic(rig.prefill(batch_size, n), rounds=PREFILL_ROUNDS, warmup_rounds=1,
                       iterations=1)
    median = _median(benchmark)
    if median is None:
        return
    if batch_size == 1:
        baselines.seconds["prefill_batch"] = median
    tokens_per_s = batch_size * n / median
    base_tokens_per_s = n / baselines.get("prefill_batch")
    benchmark.extra_info.update({"tokens": batch_size * n, "tokens_per_s": tokens_per_s,
                                 "tokens_per_s_vs_batch_1": tokens_per_s / base_tokens_per_s})


@pytest.mark.parametrize("batch_size", CONFIG.decode_batch_sizes,
                         ids=[f"batch-{b}" for b in CONFIG.decode_batch_sizes])
def test_decode_step(benchmark, rig, baselines, batch_size):
    benchmark.group = (f"engine {CONFIG.model}: decode step, {CONFIG.context_tokens} tokens of "
                       "context per sequence")
    benchmark.pedantic(rig.decode(batch_size), rounds=DECODE_ROUNDS,
                       warmup_rounds=CONFIG.decode_steps, iterations=1)
    median = _median(benchmark)
    if median is None:
        return
    if batch_size == 1:
        baselines.seconds["decode"] = median
    base = baselines.get("decode")
    benchmark.extra_info.update({
        "batch_size": batch_size, "tokens_per_s": batch_size / median,
        "tokens_per_s_vs_batch_1": batch_size / median / (1 / base),
        "step_time_vs_batch_1": median / base,
    })
