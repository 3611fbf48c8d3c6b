"""Serving benchmark: one seeded request trace replayed against ``kvmove-serve`` in each mode
(colocated, chunked prefill, disaggregated prefill/decode). No printing: the CLI formats
(``kvmove.bench.serve_report``).

The trace mixes two kinds of request, in exact proportion and shuffled:

* **long** (summarisation-like): a long prompt, a short answer — prefill-heavy;
* **short** (chat-like): a short prompt, a long answer — decode-heavy.

Arrivals are a Poisson process (exponential gaps at ``rate`` per second, the first at 0).
Prompts are ASCII, so their length in bytes is their length in tokens minus the BOS with the
presets' byte tokenizer; each begins with its request's index so that no two share a first
KV block and prefix reuse cannot skip a prefill. Every mode gets the same trace.

Per mode a fresh server starts (its own session, a free port), the trace is replayed with the
official ``openai`` client (streaming, ``ignore_eos`` so every request yields exactly
``max_tokens``), ``/metrics`` is sampled every ``sample_interval`` for the per-pool queue
lengths, and the server is stopped with SIGTERM (SIGKILL to its whole session after the
deadline; anything of it still alive after it exits is killed too).

What a request records, on the client's ``time.monotonic()``: when it was sent and when each
token's chunk arrived. A chunk carries a token unless it has a ``finish_reason`` (the closing
chunk, as OpenAI's, carries none); a token that ends inside a UTF-8 character arrives as a chunk
with empty text and still counts. TTFT is sent -> first token chunk; ITLs are the gaps between
token chunks. Goodput counts requests that finished with every token, TTFT <= ``ttft_slo`` and
mean ITL (time per output token after the first) <= ``itl_slo``: the mean, as DistServe and
vLLM's benchmark define it, because one stall of this shared CPU would otherwise disqualify a
request; the stalls themselves show in ITL p99 and max.

The KV hand-off share (disagg) is the server's ``kvmove_kv_exposed_seconds`` mean over the
client's mean TTFT: per request, from the prefill's last layer posted to that layer landed in
the decode worker's blocks, the part of the transfer that layer-wise streaming leaves on the
critical path. ``kvmove_kv_transfer_seconds`` (first layer posted to last landed) is the whole
transfer, mostly hidden behind the prefill's compute.

Defaults: the ``small`` preset (8 layers, hidden 512), where on the 2-core CI machine a
1,025-token prefill takes ~1.4 s and a decode step 15-30 ms (one core per worker): prefill far
costlier than a decode step, which is what makes colocated decode stall. ``tiny`` is
overhead-bound (its decode step costs less than the HTTP chunk it produces), so it would
compare the router, not the modes. 40 requests at 2/s, half of each kind, load two workers to
the knee, where the modes part. Measured on the quiet machine: the whole default run in 94-96
s (each server ready in 4-5 s, each replay 24-28 s); 132 s while another job's servers shared
the cores, which also pushed every mode past its SLOs. At the default load colocated's ITL p99
was ~1.7 s (decodes behind whole prefills), chunked's ~0.34 s, disagg's ~0.1 s, while its one
prefill worker queued prompts (TTFT p50 ~3 s against ~1-2 s).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import random
import re
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvmove.bench.transfer_report import BenchError
from kvmove.errors import ConfigError
from kvmove.validation import require_positive_finite, require_positive_int

__all__ = ["KINDS", "MODES", "ModeResult", "QueueSample", "RequestResult", "ServeConfig",
           "ServeReport", "ServerProcess", "TraceRequest", "count_steps", "make_trace",
           "parse_metrics", "percentile", "replay", "run"]

logger = logging.getLogger(__name__)

MODES = ("colocated", "chunked", "disagg")
KINDS = ("long", "short")  # summarisation-like, chat-like
READY = "kvmove-serve ready on "
_ALPHABET = string.ascii_lowercase + " "

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What ``run`` measures.

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
    url: str | None = None
    timeout: float = 120.0
    sample_interval: float = 0.25

    def __post_init__(self) -> None:
        if isinstance(self.modes, (list, str)):  # as argparse gives them
            modes = (self.modes,) if isinstance(self.modes, str) else tuple(self.modes)
            object.__setattr__(self, "modes", modes)
        _check_modes(self.modes)
        for name in ("workers", "chunk_size", "num_requests", "long_prompt_bytes",
                     "long_output_tokens", "short_prompt_bytes", "short_output_tokens"):
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
        if "disagg" in self.modes:
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
        if mode == "disagg":
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


def _check_url(url: Any, modes: tuple[str, ...]) -> None:
    if not isinstance(url, str) or not re.match(r"https?://[^/\s]+/?$", url):
        raise ConfigError(f"url must be http://HOST:PORT, got {url!r}")
    if len(modes) != 1:
        raise ConfigError(f"with url, modes must name the server's one mode, got {modes}")


# --- the trace ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace: ``arrival`` in seconds after the first request's."""

    index: int
    arrival: float
    kind: str
    prompt: str  # ASCII: len(prompt) bytes
    max_tokens: int


def make_trace(config: ServeConfig) -> tuple[TraceRequest, ...]:
    """The seeded trace: same config, same trace, whatever the mode.

    The kinds are an exact ``round(num_requests * long_fraction)`` long requests, shuffled,
    rather than a coin per request, so that a short trace has the mix it asks for.
    """
    rng = random.Random(config.seed)
    num_long = round(config.num_requests * config.long_fraction)
    kinds = ["long"] * num_long + ["short"] * (config.num_requests - num_long)
    rng.shuffle(kinds)
    arrival, trace = 0.0, []
    for index, kind in enumerate(kinds):
        if index:
            arrival += rng.expovariate(config.rate)
        prompt_bytes, max_tokens = config.lengths(kind)
        trace.append(TraceRequest(index, arrival, kind, _prompt(rng, index, prompt_bytes),
                                  max_tokens))
    return tuple(trace)


def _prompt(rng: random.Random, index: int, nbytes: int) -> str:
    head = f"{index:05d}:"
    return (head + "".join(rng.choices(_ALPHABET, k=max(nbytes - len(head), 0))))[:nbytes]


# --- statistics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks
    (numpy's default); NaN when ``values`` is empty."""
    if not values:
        return math.nan
    ranked = sorted(values)
    position = (len(ranked) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw of one request: ``token_times`` in seconds after ``sent`` (itself
    seconds after the replay started), ``end`` when its response closed or failed."""

    index: int
    kind: str
    max_tokens: int
    sent: float
    token_times: tuple[float, ...]
    end: float
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def completed(self) -> bool:
        return self.error is None and self.tokens == self.max_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean ITL: (last token - first) / (tokens - 1); None below two tokens."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def meets(self, ttft_slo: float, itl_slo: float) -> bool:
        tpot = self.tpot
        return (self.completed and self.ttft is not None and self.ttft <= ttft_slo
                and (tpot is None or tpot <= itl_slo))


@dataclass(frozen=True, slots=True)
class QueueSample:
    """``/metrics`` at ``time`` seconds after the replay started: per pool, requests queued
    and running."""

    time: float
    queued: dict[str, float]
    running: dict[str, float]


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's replay of the trace; ``kv_*`` are deltas of the server's counters over it."""

    mode: str
    instances: dict[str, int]
    requests: tuple[RequestResult, ...]
    samples: tuple[QueueSample, ...]
    kv_bytes: float = 0.0
    kv_transfer_seconds: float = 0.0
    kv_transfers: int = 0
    kv_exposed_seconds: float = 0.0
    startup_seconds: float | None = None
    exit_code: int | None = None

    @property
    def wall_seconds(self) -> float:
        """First request sent to last response closed."""
        if not self.requests:
            return 0.0
        return (max(r.sent + r.end for r in self.requests) -
                min(r.sent for r in self.requests))

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.requests if r.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [gap for r in self.requests for gap in r.itls]

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def itl(self, q: float) -> float:
        return percentile(self.itls, q)

    @property
    def itl_spread(self) -> float:
        """ITL p99 / p50: how far the tail stands off the typical gap."""
        return self.itl(99) / self.itl(50)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        wall = self.wall_seconds
        return self.output_tokens / wall if wall > 0 else math.nan

    @property
    def failures(self) -> int:
        return sum(not r.completed for r in self.requests)

    def good(self, ttft_slo: float, itl_slo: float) -> int:
        return sum(r.meets(ttft_slo, itl_slo) for r in self.requests)

    def goodput(self, ttft_slo: float, itl_slo: float) -> float:
        """Requests within both SLOs per second of wall time."""
        wall = self.wall_seconds
        return self.good(ttft_slo, itl_slo) / wall if wall > 0 else math.nan

    @property
    def kv_share(self) -> float | None:
        """Mean exposed KV transfer seconds over mean TTFT; None without hand-offs."""
        if not self.kv_transfers or not self.ttfts:
            return None
        return (self.kv_exposed_seconds / self.kv_transfers) / (sum(self.ttfts) /
                                                                 len(self.ttfts))

    def to_dict(self, ttft_slo: float, itl_slo: float) -> dict[str, Any]:
        qs = (50, 90, 99)
        return {
            "mode": self.mode, "instances": self.instances,
            "requests": len(self.requests), "failures": self.failures,
            "wall_seconds": self.wall_seconds, "output_tokens": self.output_tokens,
            "tokens_per_s": self.tokens_per_s,
            **{f"ttft_p{q}_ms": self.ttft(q) * 1e3 for q in qs},
            **{f"itl_p{q}_ms": self.itl(q) * 1e3 for q in qs},
            "itl_max_ms": max(self.itls, default=math.nan) * 1e3,
            "itl_p99_over_p50": self.itl_spread,
            "good_requests": self.good(ttft_slo, itl_slo),
            "goodput_per_s": self.goodput(ttft_slo, itl_slo),
            "kv_bytes": self.kv_bytes, "kv_transfers": self.kv_transfers,
            "kv_transfer_seconds": self.kv_transfer_seconds,
            "kv_exposed_seconds": self.kv_exposed_seconds, "kv_share_of_ttft": self.kv_share,
            "startup_seconds": self.startup_seconds, "exit_code": self.exit_code,
            "per_request": [{**asdict(r), "ttft": r.ttft, "tpot": r.tpot,
                             "completed": r.completed} for r in self.requests],
            "queue_samples": [asdict(s) for s in self.samples],
        }


@dataclass(frozen=True, slots=True)
class ServeReport:
    """Everything one ``run`` measured; ``to_dict`` is the ``--json`` form."""

    config: ServeConfig
    trace: tuple[TraceRequest, ...] = field(repr=False)
    modes: tuple[ModeResult, ...]
    wall_seconds: float

    @property
    def baseline(self) -> ModeResult:
        return self.modes[0]

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": asdict(c),
            "trace": [{"index": t.index, "arrival": t.arrival, "kind": t.kind,
                       "prompt_bytes": len(t.prompt), "max_tokens": t.max_tokens}
                      for t in self.trace],
            "modes": [m.to_dict(c.ttft_slo, c.itl_slo) for m in self.modes],
            "wall_seconds": self.wall_seconds,
        }


# --- the server -----------------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``kvmove-serve`` for one mode, in its own session (so that it and every worker it
    starts can be killed as a group), on a free port of 127.0.0.1. A context manager:
    entering waits for the ready line, leaving stops it."""

    def __init__(self, config: ServeConfig, mode: str) -> None:
        self.command = [sys.executable, "-m", "kvmove.serve.cli", "--mode", mode,
                        "--model", config.model, "--chunk-size", str(config.chunk_size),
                        "--host", "127.0.0.1", "--port", str(_free_port("127.0.0.1"))]
        for option, count in config.instances(mode).items():
            self.command += [f"--{option}", str(count)]
        self.timeout = config.timeout
        self.url = ""
        self.startup_seconds = math.nan
        self.exit_code: int | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would block it
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        start = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=self._stderr,
                                         text=True, start_new_session=True,
                                         env={**os.environ, "PYTHONSAFEPATH": "1"})
        except BaseException:
            self._stderr.close()
            raise
        threading.Thread(target=self._read_stdout, daemon=True).start()
        try:
            self.url = self._wait_ready(start + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_stdout(self) -> None:
        """Drains the server's stdout (a full pipe would block it); None marks its end, when
        the server and every process that inherited the pipe are gone."""
        assert self.proc is not None and self.proc.stdout is not None
        with self.proc.stdout as stdout:
            for line in stdout:
                self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self, deadline: float) -> str:
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise BenchError(f"kvmove-serve was not ready after {self.timeout:g} s: "
                                 f"{self.stderr_tail()}") from None
            if line is None:
                code = self.proc.wait(self.timeout) if self.proc else None
                raise BenchError(f"kvmove-serve exited with status {code} before it was "
                                 f"ready: {self.stderr_tail()}")
            if line.startswith(READY):
                return line[len(READY):].split()[0].rstrip("/")

    def stderr_tail(self, num_lines: int = 15) -> str:
        self._stderr.seek(0)
        return "".join(self._stderr.readlines()[-num_lines:]).strip() or "(no stderr)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session after ``timeout``; whatever of the
        session outlives the server (a worker it did not stop) is killed too."""
        proc, self.proc = self.proc, None
        try:
            if proc is None:
                return
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                logger.warning("kvmove-serve did not stop %g s after SIGTERM; killing it",
                               self.timeout)
            finally:
                if proc.returncode is None:  # past the deadline, or interrupted waiting
                    _kill_session(proc.pid)
                    self.exit_code = proc.wait(self.timeout)
            if _kill_session(proc.pid):
                logger.warning("kvmove-serve (pid %d) left processes behind; killed them",
                               proc.pid)
        finally:
            self._stderr.close()


def _kill_session(pgid: int) -> bool:
    """SIGKILL to every process of the group ``pgid``; whether there was any."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


# --- /metrics -------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text format: sample name -> [(labels, value)]; comments skipped."""
    out: Metrics = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return out


def metric_total(metrics: Metrics, name: str) -> float:
    """The sum of ``name`` over its label sets (0 when absent)."""
    return sum(value for _, value in metrics.get(name, ()))


def by_pool(metrics: Metrics, name: str) -> dict[str, float]:
    pools: dict[str, float] = {}
    for labels, value in metrics.get(name, ()):
        pool = labels.get("pool", "")
        pools[pool] = pools.get(pool, 0.0) + value
    return pools


# --- the replay -----------------------------------------------------------------------------


async def _send(client: Any, model: str, request: TraceRequest, start: float,
                timeout: float) -> RequestResult:
    """Waits for ``request``'s arrival time, then streams it; never raises."""
    await asyncio.sleep(max(start + request.arrival - time.monotonic(), 0))
    sent = time.monotonic()
    times: list[float] = []
    error = None
    try:
        await asyncio.wait_for(_stream(client, model, request, times), timeout)
    except asyncio.TimeoutError:
        error = f"no response within {timeout:g} s ({len(times)} tokens)"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        error = f"{type(exc).__name__}: {exc}"
    end = time.monotonic()
    return RequestResult(request.index, request.kind, request.max_tokens, sent - start,
                         tuple(t - sent for t in times), end - sent, error)


async def _stream(client: Any, model: str, request: TraceRequest, times: list[float]) -> None:
    stream = await client.completions.create(
        model=model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason is None:
            times.append(time.monotonic())


async def _sample(http: Any, stop: asyncio.Event, interval: float, start: float,
                  samples: list[QueueSample]) -> None:
    """Per-pool queue lengths every ``interval`` until ``stop``; a failed sample is skipped."""
    while True:
        try:
            metrics = parse_metrics((await http.get("/metrics", timeout=interval * 4)).text)
            samples.append(QueueSample(time.monotonic() - start,
                                       by_pool(metrics, "kvmove_pool_queue_length"),
                                       by_pool(metrics, "kvmove_pool_running")))
        except Exception as exc:  # noqa: BLE001 - sampling must not end the run
            logger.debug("a /metrics sample failed: %s", exc)
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass


_KV = ("kvmove_kv_bytes_total", "kvmove_kv_transfer_seconds_sum",
       "kvmove_kv_transfer_seconds_count", "kvmove_kv_exposed_seconds_sum")


async def _kv_totals(http: Any) -> tuple[float, ...]:
    metrics = parse_metrics((await http.get("/metrics")).text)
    return tuple(metric_total(metrics, name) for name in _KV)


async def replay(config: ServeConfig, trace: Sequence[TraceRequest], url: str, mode: str,
                 progress: Progress) -> ModeResult:
    """Sends ``trace`` to the server at ``url`` on its schedule; waits for every response."""
    import httpx
    from openai import AsyncOpenAI

    model = os.path.basename(config.model.rstrip("/"))
    async with httpx.AsyncClient(base_url=url, timeout=config.timeout) as http, \
            AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                        timeout=config.timeout) as client:
        before = await _kv_totals(http)
        stop, samples = asyncio.Event(), list[QueueSample]()
        start = time.monotonic()
        sampler = asyncio.create_task(_sample(http, stop, config.sample_interval, start,
                                              samples))

        async def one(request: TraceRequest) -> RequestResult:
            result = await _send(client, model, request, start, config.timeout)
            progress(f"{mode}: request {request.index}")
            return result

        try:
            results = await asyncio.gather(*(one(r) for r in trace))
        finally:
            stop.set()
            await sampler
        after = await _kv_totals(http)
    kv_bytes, kv_seconds, kv_count, kv_exposed = (b - a for a, b in zip(before, after))
    return ModeResult(mode, config.instances(mode), tuple(results), tuple(samples),
                      kv_bytes, kv_seconds, round(kv_count), kv_exposed)


def _run_mode(config: ServeConfig, mode: str, trace: Sequence[TraceRequest],
              progress: Progress) -> ModeResult:
    if config.url is not None:
        progress(f"{mode}: using {config.url}")
        result = asyncio.run(replay(config, trace, config.url.rstrip("/"), mode, progress))
        progress(f"{mode}: done")
        return result
    with ServerProcess(config, mode) as server:
        logger.info("kvmove-serve %s ready on %s in %.1f s", mode, server.url,
                    server.startup_seconds)
        progress(f"{mode}: server ready")
        result = asyncio.run(replay(config, trace, server.url, mode, progress))
    progress(f"{mode}: server stopped")
    return replace(result, startup_seconds=server.startup_seconds, exit_code=server.exit_code)


def run(config: ServeConfig, progress: Progress | None = None) -> ServeReport:
    """Replays one trace against each of ``config.modes`` (a fresh server each).

    Raises:
        BenchError: a server did not start in time, or exited before it was ready.
    """
    progress = progress or (lambda label: None)
    wall = time.perf_counter()
    trace = make_trace(config)
    modes = tuple(_run_mode(config, mode, trace, progress) for mode in config.modes)
    return ServeReport(config, trace, modes, time.perf_counter() - wall)


def count_steps(config: ServeConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    return len(config.modes) * (config.num_requests + 2)
