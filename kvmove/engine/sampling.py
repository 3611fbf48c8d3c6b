"""Next-token choice: greedy, or temperature + top-p with each request's own generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmove.engine.request import Request

__all__ = ["sample", "skip_draw"]


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """One token per row of ``logits`` ``[len(requests), vocab]``, by each request's params."""
    out = []
    for row, request in zip(logits, requests):
        params = request.params
        if params.temperature == 0:
            out.append(int(torch.argmax(row)))
            continue
        probs = torch.softmax(row.float() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        choice = torch.multinomial(probs / probs.sum(), 1, generator=request.generator)
        out.append(int(choice))
    return out


def skip_draw(request: Request, vocab_size: int) -> None:
    """Advances the request's generator past one draw, as ``sample`` makes it: a decode
    worker that received the first token from the prefill worker continues the seeded
    sequence where the prefill worker left it, so a seeded request gives the same tokens
    disaggregated and colocated. (``multinomial`` draws one exponential per vocabulary entry
    whatever the probabilities, so a uniform row consumes exactly as much.)"""
    if request.params.temperature > 0:
        torch.multinomial(torch.full((vocab_size,), 1.0 / vocab_size), 1,
                          generator=request.generator)
