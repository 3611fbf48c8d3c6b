"""The serving benchmark's configuration (``ServeBenchConfig``): which modes, how many
workers, the trace's shape and the SLOs, each checked when it is made. ``serve.py`` runs it.
Named for its side: ``kvmove.serve.config.ServeConfig`` is the server's own."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvmove.errors import ConfigError
from kvmove.serve.config import MODES, ROUTINGS, Mode
from kvmove.serve.planner import parse_bounds
from kvmove.validation import require_positive_finite, require_positive_int

__all__ = ["KINDS", "MODES", "PLANNERS", "ROUTINGS", "ServeBenchConfig"]

PLANNERS = ("off", "on")  # kvmove-serve --planner (disagg only)
KINDS = ("long", "short")  # summarisation-like, chat-like


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """What ``serve.run`` measures.

    Args:
        modes: subset of ``MODES``, in order; the first is the baseline of the ratios.
        workers: engine processes per mode: colocated / chunked run ``workers`` instances,
            disagg ``prefill`` + ``decode``.
        prefill / decode: disagg's instances (None: ``workers // 2`` prefill, the rest decode).
        model: ``kvmove-serve --model`` (a preset, or a directory: lengths stay in bytes).
        chunk_size: prefill chunk in tokens (chunked, and disagg's prefill workers).
        num_requests: requests in the trace.
        rate: mean arrivals per second (Poisson).
        long_fraction: share of long (summarisation-like) requests, rounded to a count.
        long_prompt_bytes / long_output_tokens: a long request's prompt and ``max_tokens``.
        short_prompt_bytes / short_output_tokens: a short (chat-like) one's.
        ttft_slo / itl_slo: seconds; goodput counts requests within both (ITL: the mean).
        seed: the trace (arrivals, kinds, prompts).
        routings: ``kvmove-serve --routing`` values; each mode runs once per routing (the
            first mode with the first routing is the baseline of the ratios).
        shared_prefixes: 0, or how many shared prefixes the trace's prompts begin with (each
            request picks one, seeded): the first request of a prefix computes it, later ones
            (its repeats) can find it cached, which is what KV-aware routing is for.
        prefix_bytes: a shared prefix's length; the prompt lengths are what follows it.
        planners: ``PLANNERS`` values; disagg runs once per value ("on": ``kvmove-serve
            --planner``), the other modes once, without it.
        prefill_workers / decode_workers: the planner's bounds per pool, ``"MIN:MAX"`` (None:
            kvmove-serve's default, 1 to twice the pool's starting size).
        url: a running server to use instead of starting one (then ``modes`` names its mode,
            exactly one).
        timeout: deadline in seconds of every wait: the server's start and stop, each request.
        sample_interval: seconds between ``/metrics`` samples.
    """

    modes: tuple[str, ...] = MODES
    workers: int = 2
    prefill: int | None = None
    decode: int | None = None
    model: str = "small"
    chunk_size: int = 256
    num_requests: int = 40
    rate: float = 2.0
    long_fraction: float = 0.5
    long_prompt_bytes: int = 1024
    long_output_tokens: int = 16
    short_prompt_bytes: int = 64
    short_output_tokens: int = 128
    ttft_slo: float = 2.0
    itl_slo: float = 0.1
    seed: int = 0
    routings: tuple[str, ...] = ("kv",)
    shared_prefixes: int = 0
    prefix_bytes: int = 512
    planners: tuple[str, ...] = ("off",)
    prefill_workers: str | None = None
    decode_workers: str | None = None
    url: str | None = None
    timeout: float = 120.0
    sample_interval: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.modes, (list, str)):  # as argparse gives them
            modes = (self.modes,) if isinstance(self.modes, str) else tuple(self.modes)
            object.__setattr__(self, "modes", modes)
        _check_modes(self.modes)
        if isinstance(self.routings, (list, str)):
            routings = (self.routings,) if isinstance(self.routings, str) else tuple(
                self.routings)
            object.__setattr__(self, "routings", routings)
        _check_routings(self.routings)
        if isinstance(self.planners, (list, str)):
            planners = (self.planners,) if isinstance(self.planners, str) else tuple(
                self.planners)
            object.__setattr__(self, "planners", planners)
        _check_planners(self.planners, self)
        if isinstance(self.shared_prefixes, bool) or not isinstance(
                self.shared_prefixes, int) or self.shared_prefixes < 0:
            raise ConfigError(f"shared_prefixes must be an int >= 0, got "
                              f"{self.shared_prefixes!r}")
        for name in ("workers", "chunk_size", "num_requests", "long_prompt_bytes",
                     "long_output_tokens", "short_prompt_bytes", "short_output_tokens",
                     "prefix_bytes"):
            require_positive_int(name, getattr(self, name))
        for name in ("prefill", "decode"):
            if getattr(self, name) is not None:
                require_positive_int(name, getattr(self, name))
        for name in ("rate", "ttft_slo", "itl_slo", "timeout", "sample_interval"):
            require_positive_finite(name, getattr(self, name))
        if isinstance(self.long_fraction, bool) or not isinstance(
                self.long_fraction, (int, float)) or not 0 <= self.long_fraction <= 1:
            raise ConfigError(f"long_fraction must be in [0, 1], got {self.long_fraction!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if Mode.DISAGG in self.modes:
            self.disagg_instances()  # validates workers against prefill / decode
        if self.url is not None:
            _check_url(self.url, self.modes)
        self._check_context()

    def disagg_instances(self) -> tuple[int, int]:
        """(prefill, decode) instances of the disagg mode."""
        prefill = self.prefill if self.prefill is not None else self.workers // 2
        decode = self.decode if self.decode is not None else self.workers - prefill
        if prefill < 1 or decode < 1:
            raise ConfigError(f"disagg needs a prefill and a decode worker: workers = "
                              f"{self.workers} gives {prefill} prefill + {decode} decode")
        return prefill, decode

    def instances(self, mode: str) -> dict[str, int]:
        """``kvmove-serve``'s instance counts for ``mode``, by option name."""
        if mode == Mode.DISAGG:
            prefill, decode = self.disagg_instances()
            return {"prefill": prefill, "decode": decode}
        return {"workers": self.workers}

    def lengths(self, kind: str) -> tuple[int, int]:
        """(prompt bytes, max_tokens) of a request of ``kind``."""
        if kind == "long":
            return self.long_prompt_bytes, self.long_output_tokens
        return self.short_prompt_bytes, self.short_output_tokens

    def _check_context(self) -> None:
        try:  # the engine (torch) is the server's; without it the server checks alone
            from kvmove.engine.model import MODEL_PRESETS
        except ImportError:
            return
        if self.model not in MODEL_PRESETS:
            return
        limit = MODEL_PRESETS[self.model].max_position_embeddings
        for kind in KINDS:
            prompt_bytes, max_tokens = self.lengths(kind)
            prompt_bytes += self.prefix_bytes if self.shared_prefixes else 0
            if prompt_bytes + 1 + max_tokens > limit:
                raise ConfigError(f"a {kind} request needs {prompt_bytes} + 1 (BOS) + "
                                  f"{max_tokens} positions, {self.model} has {limit}")


def _check_modes(modes: Any) -> None:
    if not isinstance(modes, tuple) or not modes:
        raise ConfigError(f"modes must be a non-empty tuple of {MODES}, got {modes!r}")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ConfigError(f"modes must not repeat a mode, got {modes}")


def _check_routings(routings: Any) -> None:
    if not isinstance(routings, tuple) or not routings or len(set(routings)) != len(routings) \
            or any(r not in ROUTINGS for r in routings):
        raise ConfigError(f"routings must be distinct values of {ROUTINGS}, got {routings!r}")


def _check_planners(planners: Any, config: ServeBenchConfig) -> None:
    if not isinstance(planners, tuple) or not planners or len(set(planners)) != len(planners) \
            or any(p not in PLANNERS for p in planners):
        raise ConfigError(f"planners must be distinct values of {PLANNERS}, got {planners!r}")
    for name in ("prefill_workers", "decode_workers"):
        bounds = getattr(config, name)
        if bounds is not None:
            if "on" not in planners:
                raise ConfigError(f"{name} bounds the planner: give planners 'on' too")
            parse_bounds(bounds)  # ConfigError naming the value


def _check_url(url: Any, modes: tuple[str, ...]) -> None:
    if not isinstance(url, str) or not re.match(r"https?://[^/\s]+/?$", url):
        raise ConfigError(f"url must be http://HOST:PORT, got {url!r}")
    if len(modes) != 1:
        raise ConfigError(f"with url, modes must name the server's one mode, got {modes}")
