"""A request's life in the engine: its tokens, its blocks, its sampling and its timings.

A request's KV covers ``tokens[:num_computed]``; a step computes ``tokens[num_computed:...]``
(a prefill chunk, or the one token sampled last) and, once every known token is computed,
samples the next one. A preempted request frees its blocks and starts over from the
prefix cache, recomputing prompt *and* output: the same loop resumes it.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvmove.errors import ConfigError

if TYPE_CHECKING:
    from kvmove.engine.detokenizer import Detokenizer

__all__ = ["FinishReason", "Request", "RequestState", "SamplingParams", "Timings"]


class RequestState(enum.Enum):
    WAITING = "waiting"            # queued for (re)admission
    FETCHING = "fetching"          # out of the queue while its prefix comes from the store
    RUNNING = "running"            # in the batch: prefill chunks, then decode steps
    LOADING = "loading"            # decode role: its KV is streaming in
    HANDING_OFF = "handing_off"    # prefill role: its KV is streaming out
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"           # EOS or a stop string
    LENGTH = "length"       # max_tokens
    HANDED_OFF = "handed_off"  # prefill role: decode goes on elsewhere
    ABORT = "abort"         # cancelled, or its KV hand-off failed


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request generates: OpenAI's names and meanings.

    ``temperature`` 0 is greedy; otherwise softmax at that temperature, restricted to the
    smallest set of tokens whose probability reaches ``top_p``, drawn with a generator seeded
    by ``seed`` (so a request with a seed is reproducible).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or \
                self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ConfigError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or
                                      not isinstance(self.seed, int) or
                                      not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be non-empty strings, got {self.stop!r}")


@dataclass
class Timings:
    """Recorded where they happen, on ``time.monotonic()``."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    tokens: list[float] = field(default_factory=list)  # every sampled token, first included
    kv_start: float | None = None   # KV hand-off started (prefill: stream opened)
    kv_end: float | None = None     # and ended (prefill: acknowledged; decode: all in, seen)
    # The hand-off's timeline (docs/serving.md): prefill side
    last_layer: float | None = None  # its last layer computed (the hook ran)
    kv_sent: float | None = None     # every layer's bytes landed in the decode's blocks
    kv_final: float | None = None    # first token sampled, the final message handed over
    # decode side
    kv_landed: float | None = None   # the last layer's "landed" message arrived
    first_step: float | None = None  # the first forward pass with it began

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive tokens."""
        return [b - a for a, b in zip(self.tokens, self.tokens[1:])]


class Request:
    """One generation request; the engine owns it from ``add_request`` to its finish."""

    def __init__(self, request_id: str, prompt: list[int],
                 params: SamplingParams | None = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id must be a non-empty str, got {request_id!r}")
        if not prompt:
            raise ConfigError(f"request {request_id!r} has an empty prompt")
        self.id = request_id
        self.prompt = list(prompt)
        self.params = params or SamplingParams()
        self.output: list[int] = []
        self.text = ""  # the decoded output, cut before a stop string (set once it ends)
        self.detokenizer: Detokenizer | None = None  # its text so far (the worker's)
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.blocks: list[int] = []     # block table
        self.num_computed = 0           # tokens whose K/V are in the cache
        self.num_cached = 0             # of those, prompt tokens taken from the prefix cache
        self.num_stored = 0             # of those, tokens whose KV came from the KVStore
        self.hashes: list[int] = []     # chain hashes of its full blocks, tagged in the pool
        self.num_preemptions = 0
        self.kv_bytes = 0               # KV handed off (prefill role)
        self.kv_seconds: float | None = None          # first layer posted -> last landed
        self.kv_exposed_seconds: float | None = None  # last layer posted -> last landed
        self.timings = Timings()
        self.generator = torch.Generator()
        self.generator.manual_seed(self.params.seed if self.params.seed is not None else
                                   torch.seed())

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than the last sampled token still needs computing."""
        return self.num_uncomputed > 1 or not self.output

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Request({self.id!r}, prompt {len(self.prompt)}, output {len(self.output)}, "
                f"computed {self.num_computed}, {self.state.value})")
