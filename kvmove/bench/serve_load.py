"""The serving benchmark's load (``serve``): the trace (``serve_trace``) replayed against a
server with the official ``openai`` client while ``/metrics`` is sampled.

What a request records, on the client's ``time.monotonic()``: when it was sent and when each
token's chunk arrived. A chunk carries a token unless it has a ``finish_reason`` (the closing
chunk, as OpenAI's, carries none); a token that ends inside a UTF-8 character arrives as a chunk
with empty text and still counts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvmove.bench.serve_report import ModeResult, QueueSample, RequestResult

if TYPE_CHECKING:
    from kvmove.bench.serve_config import ServeBenchConfig
    from kvmove.bench.serve_trace import TraceRequest

__all__ = ["Metrics", "by_pool", "metric_total", "parse_metrics", "replay"]

logger = logging.getLogger(__name__)


# --- /metrics -------------------------------------------------------------------------------

Metrics = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Metrics:
    """Prometheus text format, read by ``prometheus_client``'s own parser: sample name (a
    counter's ``..._total``, a histogram's ``..._sum``) -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_total(metrics: Metrics, name: str) -> float:
    """The sum of ``name`` over its label sets (0 when absent)."""
    return sum(value for _, value in metrics.get(name, ()))


def by_pool(metrics: Metrics, name: str) -> dict[str, float]:
    return by_label(metrics, name, "pool")


def by_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """The sum of ``name`` per value of ``label``."""
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, ()):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


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
    except TimeoutError:
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
                                       by_pool(metrics, "kvmove_pool_running"),
                                       by_pool(metrics, "kvmove_pool_workers")))
        except Exception as exc:  # noqa: BLE001 - sampling must not end the run
            logger.debug("a /metrics sample failed: %s", exc)
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except TimeoutError:
            pass


_KV = ("kvmove_kv_bytes_total", "kvmove_kv_transfer_seconds_sum",
       "kvmove_kv_transfer_seconds_count", "kvmove_kv_exposed_seconds_sum",
       "kvmove_kv_handoff_seconds_sum", "kvmove_kv_handoff_seconds_count",
       "kvmove_routing_matched_tokens_sum", "kvmove_routing_matched_tokens_count")
_STAGES = "kvmove_kv_handoff_stage_seconds"


async def _kv_totals(http: Any) -> tuple[tuple[float, ...], dict[str, float],
                                         dict[str, float], dict[str, float]]:
    """The KV counters (``_KV``), the hand-off stages' sums and counts, and the planner's
    decisions ("pool action reason" -> count)."""
    metrics = parse_metrics((await http.get("/metrics")).text)
    return (tuple(metric_total(metrics, name) for name in _KV),
            by_label(metrics, f"{_STAGES}_sum", "stage"),
            by_label(metrics, f"{_STAGES}_count", "stage"),
            {f"{labels['pool']} {labels['action']} {labels['reason']}": value
             for labels, value in metrics.get("kvmove_planner_decisions_total", ())})


def stage_means(before: tuple[dict[str, float], dict[str, float]],
                after: tuple[dict[str, float], dict[str, float]]) -> dict[str, float]:
    """Each hand-off stage's mean seconds over the run, from ``(sums, counts)`` before and
    after it; stages with no observation left out."""
    (sums0, counts0), (sums1, counts1) = before, after
    means = {}
    for stage, count in counts1.items():
        n = count - counts0.get(stage, 0.0)
        if n > 0:
            means[stage] = (sums1.get(stage, 0.0) - sums0.get(stage, 0.0)) / n
    return means


async def replay(config: ServeBenchConfig, trace: Sequence[TraceRequest], url: str, mode: str,
                 progress: Callable[[str], None]) -> ModeResult:
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
    kv_bytes, kv_seconds, kv_count, kv_exposed, handoff, handoffs, matched, routed = (
        b - a for a, b in zip(before[0], after[0]))
    return ModeResult(mode, config.instances(mode), tuple(results), tuple(samples),
                      kv_bytes, kv_seconds, round(kv_count), kv_exposed,
                      kv_handoff_seconds=handoff, kv_handoffs=round(handoffs),
                      kv_timeline=stage_means(before[1:3], after[1:3]),
                      matched_tokens=matched, routed=round(routed),
                      planner_decisions={key: round(n - before[3].get(key, 0.0))
                                         for key, n in after[3].items()
                                         if n > before[3].get(key, 0.0)})
