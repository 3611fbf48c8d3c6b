"""The colocated reference engine's greedy answers, which served ones must equal."""

from __future__ import annotations

from collections.abc import Sequence

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import Request, SamplingParams
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.tokenizer import ByteTokenizer
from kvmove.engine.worker import EngineWorker

TINY = MODEL_PRESETS["tiny"]
TOKENIZER = ByteTokenizer(TINY.bos_token_id, TINY.eos_token_id)


def greedy_tokens(prompts: Sequence[str], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from a colocated engine here (the tiny preset, seed 0: the
    weights every worker builds; no prefix caching, no kvmove hand-off)."""
    worker = EngineWorker(LlamaForCausalLM.random(TINY, seed=0), num_blocks=256,
                          block_size=16,
                          scheduler=SchedulerConfig(chunk_size=None, prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = {p: Request(f"r{i}", TOKENIZER.encode(p), params) for i, p in enumerate(prompts)}
    for request in requests.values():
        worker.add_request(request)
    worker.run()
    return {p: r.output for p, r in requests.items()}
