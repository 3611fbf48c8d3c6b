"""The serving benchmark's request trace (``make_trace``): seeded, the same for every mode.

The trace mixes two kinds of request, in exact proportion and shuffled:

* **long** (summarisation-like): a long prompt, a short answer — prefill-heavy;
* **short** (chat-like): a short prompt, a long answer — decode-heavy.

Arrivals are a Poisson process (exponential gaps at ``rate`` per second, the first at 0).
Prompts are ASCII, so their length in bytes is their length in tokens minus the BOS with the
presets' byte tokenizer; each begins with its request's index so that no two share a first
KV block and prefix reuse cannot skip a prefill. Every mode gets the same trace.

With ``shared_prefixes`` N > 0, every prompt is instead one of N shared prefixes
(``prefix_bytes`` each, picked per request by their own seeded generator, so the arrivals,
kinds and own prompts stay those of the trace without them) followed by the request's own
prompt: the first request of a prefix computes it, its repeats can find it cached.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmove.bench.serve_config import ServeBenchConfig

__all__ = ["TraceRequest", "make_trace"]

_ALPHABET = string.ascii_lowercase + " "


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: ``arrival`` in seconds after the first request's."""

    index: int
    arrival: float
    kind: str
    prompt: str  # ASCII: len(prompt) bytes
    max_tokens: int
    prefix: int | None = None  # the shared prefix it begins with
    repeat: bool = False       # an earlier request of the trace began with it too


def make_trace(config: ServeBenchConfig) -> tuple[TraceRequest, ...]:
    """The seeded trace: same config, same trace, whatever the mode.

    The kinds are an exact ``round(num_requests * long_fraction)`` long requests, shuffled,
    rather than a coin per request, so that a short trace has the mix it asks for.
    """
    rng = random.Random(config.seed)
    shared = _SharedPrefixes(config)
    num_long = round(config.num_requests * config.long_fraction)
    kinds = ["long"] * num_long + ["short"] * (config.num_requests - num_long)
    rng.shuffle(kinds)
    arrival, trace = 0.0, []
    for index, kind in enumerate(kinds):
        if index:
            arrival += rng.expovariate(config.rate)
        prompt_bytes, max_tokens = config.lengths(kind)
        own = _prompt(rng, index, prompt_bytes)
        trace.append(shared.apply(TraceRequest(index, arrival, kind, own, max_tokens)))
    return tuple(trace)


class _SharedPrefixes:
    """The trace's shared prefixes, from their own generator (seeded by the trace's seed)."""

    def __init__(self, config: ServeBenchConfig) -> None:
        rng = random.Random(f"shared-prefixes:{config.seed}")
        self.rng = rng
        self.texts = [_prompt(rng, j, config.prefix_bytes).replace(":", "#", 1)
                      for j in range(config.shared_prefixes)]
        self.seen: set[int] = set()

    def apply(self, request: TraceRequest) -> TraceRequest:
        if not self.texts:
            return request
        j = self.rng.randrange(len(self.texts))
        repeat = j in self.seen
        self.seen.add(j)
        return replace(request, prompt=self.texts[j] + request.prompt, prefix=j, repeat=repeat)


def _prompt(rng: random.Random, index: int, nbytes: int) -> str:
    head = f"{index:05d}:"
    return (head + "".join(rng.choices(_ALPHABET, k=max(nbytes - len(head), 0))))[:nbytes]
