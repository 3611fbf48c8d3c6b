"""The colocated reference engine's greedy answers, which served ones must equal."""

from __future__ import annotations

from collections.abc import Sequence

from kvmove.bench import soak


def greedy_tokens(prompts: Sequence[str], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from a colocated engine here (the tiny preset, seed 0: the
    weights every worker builds; no prefix caching, no kvmove hand-off)."""
    return soak.greedy_tokens("tiny", list(prompts), max_tokens)
