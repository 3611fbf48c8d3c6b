"""The measuring half of ``kvmove-bench engine`` (``engine``): the model and the one
``KVCache`` every row runs against, the timing, and ``run``. It imports torch, so it is
imported only when the benchmark runs.

Cache regions (block ids), so that no row overwrites another's context::

    [0, prefill_blocks)                      prefill rows (each run overwrites the last)
    [prefill_blocks, + batch * seq_blocks)   decode sequences, seq_blocks each
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmove.bench.engine_report import DecodeRow, EngineConfig, EngineReport, PrefillRow
from kvmove.bench.progress import Progress
from kvmove.engine.model import LlamaForCausalLM, SeqChunk
from kvmove.kv_cache import KVCache

__all__ = ["EngineRig", "run", "time_calls"]

logger = logging.getLogger(__name__)


class EngineRig:
    """The model, one ``KVCache`` for every row, and forward calls ready to time.

    ``prefill(b, n)`` and ``decode(b)`` return zero-argument callables; the benchmark file
    times them with pytest-benchmark, ``run`` with ``perf_counter``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.model = LlamaForCausalLM.random(model_config, config.seed)
        layout = model_config.kv_spec(config.block_size)
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


def run(config: EngineConfig, progress: Progress = lambda _: None) -> EngineReport:
    """Measures every row of ``config`` (see ``engine``'s docstring), calling
    ``progress(label)`` after each (``count_steps``); about 35 s by default on two CPU
    cores."""
    start = time.perf_counter()
    rig = EngineRig(config)
    prefill = PrefillRow(1, config.prompt_tokens,
                         time_calls(rig.prefill(1, config.prompt_tokens), config.iters))
    logger.info("prefill of %d tokens: %.0f tokens/s", prefill.num_tokens, prefill.tokens_per_s)
    progress(f"prefill {config.prompt_tokens} tokens")
    batches = []
    for b in config.prefill_batch_sizes:
        seconds = time_calls(rig.prefill(b, config.batch_prompt_tokens), config.iters)
        batches.append(PrefillRow(b, config.batch_prompt_tokens, seconds))
        progress(f"prefill batch {b}")
    decode = []
    for b in config.decode_batch_sizes:
        seconds = time_calls(rig.decode(b), config.iters, config.decode_steps)
        decode.append(DecodeRow(b, config.context_tokens, config.decode_steps, seconds))
        progress(f"decode batch {b}")
    return EngineReport(
        config=config, num_params=sum(p.numel() for p in rig.model.parameters()),
        num_threads=torch.get_num_threads(), torch_version=torch.__version__,
        prefill=prefill, prefill_batches=tuple(batches), decode=tuple(decode),
        wall_seconds=time.perf_counter() - start)
