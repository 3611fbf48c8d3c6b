"""``kvmove-bench stream``: how much of the KV hand-off layer-wise streaming hides behind the
prefill that produces it. No printing: the CLI formats.

A simulated prefill runs here, on the CPU: per layer, a real float32 matmul repeated to take
``compute_ms`` (by default the measured per-layer transfer time times ``compute_ratio``), then
the layer's KV counts as written. A peer process is the decode side. Per iteration, two
hand-offs of the same blocks, every byte verified on the receiving side:

* **bulk**: compute every layer, then one ``write`` of all layers (+ notification), the
  baseline: its transfer is fully exposed.
* **stream**: ``save_layer(i)`` after each layer's compute, then ``finish`` and
  ``wait_for_save`` (the receiver's acknowledgement of the final message).

``exposed`` is the time from the end of the last layer's compute until the hand-off is done
(bulk: the whole write; stream: what is left after the last layer), and the **hidden
fraction** is ``1 - exposed_stream / exposed_bulk``. The sender's clock decides; the receiver's
arrival times (same host, same monotonic clock) are reported too.

On a CPU-only host the "prefill" and the transfer share the cores (tcp puts need the CPU on
both ends), so this understates what a GPU prefill, which leaves the CPU free, would hide.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvmove.agent import ERROR_MODES
from kvmove.bench.peer import FAR, Peer, connect_pair
from kvmove.bench.transfer_report import BenchError
from kvmove.errors import ConfigError
from kvmove.layout import KVLayout

__all__ = ["Bulk", "Iteration", "StreamConfig", "StreamPair", "StreamReport", "Streamed",
           "count_steps", "run"]

# One unit of simulated compute: a 96x96 float32 matmul, below OpenBLAS's threading threshold,
# so the "prefill" keeps to one core as a thread driving a GPU would, and leaves the others to
# the transport (a 256x256 one spreads over every core and starves UCX's threads).
MATMUL_N = 96
_CALIBRATION_BATCHES = 7
_CALIBRATION_BATCH = 100

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """What ``run`` measures.

    Args:
        model: a ``KVLayout`` preset.
        num_tokens: prompt length; ``blocks_for(num_tokens)`` blocks move.
        block_size: tokens per block.
        transports / error_mode: as ``kvmove.Agent``.
        compute_ratio: per-layer compute time as a multiple of the measured per-layer transfer
            time (bulk transfer / layers), when ``compute_ms`` is None.
        compute_ms: per-layer compute time, fixed; overrides ``compute_ratio``.
        iters: timed iterations (after one warm-up); the report shows the median one.
        timeout: deadline in seconds of every wait.
        seed: for the data pattern.
    """

    model: str = "llama-3.1-8b"
    num_tokens: int = 4000
    block_size: int = 16
    transports: str | None = None
    error_mode: str = "peer"
    compute_ratio: float = 1.0
    compute_ms: float | None = None
    iters: int = 3
    timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_tokens", "iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        self.layout()  # validates model and block_size
        if self.error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        for name in ("compute_ratio", "compute_ms", "timeout"):
            value = getattr(self, name)
            if value is None and name == "compute_ms":
                continue
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}")

    def layout(self) -> KVLayout:
        return KVLayout.preset(self.model, block_size=self.block_size)

    @property
    def agent_kwargs(self) -> dict[str, Any]:
        return {"transports": self.transports, "error_mode": self.error_mode}


@dataclass(frozen=True, slots=True)
class Iteration:
    """One bulk and one streamed hand-off, on the ``time.monotonic()`` clock.

    ``compute`` holds each layer's (start, end); ``transfer`` each layer's (posted, landed)
    as the sender saw it; ``arrived`` when the receiver got each layer's ready message.
    """

    bulk_compute_seconds: float
    bulk_transfer_seconds: float
    stream_compute_seconds: float
    stream_exposed_seconds: float
    receiver_exposed_seconds: float  # last layer's arrival at the receiver - last compute end
    save_layer_seconds: tuple[float, ...]
    compute: tuple[tuple[float, float], ...]
    transfer: tuple[tuple[float, float], ...]
    arrived: tuple[float, ...]
    mismatched_blocks: int

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.stream_exposed_seconds / self.bulk_transfer_seconds

    @property
    def layer_latency_seconds(self) -> float:
        """Median over layers of landed - posted: how long after its post a layer was in
        place (while the compute and other layers shared the machine)."""
        return layer_latency(self.transfer)

    @property
    def compute_slowdown(self) -> float:
        """Streamed prefill compute over bulk's: what sharing the machine with the transfer
        cost the compute (1.0 = nothing)."""
        return self.stream_compute_seconds / self.bulk_compute_seconds

    @property
    def speedup(self) -> float:
        """(bulk compute + transfer) over (streamed compute + exposed): the hand-off's end."""
        return ((self.bulk_compute_seconds + self.bulk_transfer_seconds) /
                (self.stream_compute_seconds + self.stream_exposed_seconds))


@dataclass(frozen=True, slots=True)
class StreamReport:
    """Everything one ``run`` measured; ``to_dict`` is ``kvmove-bench stream --json``."""

    config: StreamConfig
    num_layers: int
    num_blocks: int
    nbytes: int
    compute_ms_per_layer: float
    matmuls_per_layer: int
    iterations: tuple[Iteration, ...]
    wall_seconds: float
    warmup: Iteration = field(repr=False)

    @property
    def median(self) -> Iteration:
        """The iteration with the median hidden fraction (the lower one of an even count)."""
        ranked = sorted(self.iterations, key=lambda it: it.hidden_fraction)
        return ranked[(len(ranked) - 1) // 2]

    @property
    def verified(self) -> bool:
        return all(it.mismatched_blocks == 0 for it in (self.warmup, *self.iterations))

    @property
    def transfer_ms_per_layer(self) -> float:
        return self.median.bulk_transfer_seconds / self.num_layers * 1e3

    def to_dict(self) -> dict[str, Any]:
        m = self.median
        return {
            "config": asdict(self.config), "statistic": f"median of {self.config.iters} "
            "iterations (by hidden fraction) after 1 warm-up",
            "num_layers": self.num_layers, "num_blocks": self.num_blocks, "nbytes": self.nbytes,
            "bytes_per_layer": self.nbytes // self.num_layers,
            "compute_ms_per_layer": self.compute_ms_per_layer,
            "matmuls_per_layer": self.matmuls_per_layer,
            "transfer_ms_per_layer": self.transfer_ms_per_layer,
            "compute_over_transfer": self.compute_ms_per_layer / self.transfer_ms_per_layer,
            "layer_latency_ms": m.layer_latency_seconds * 1e3,
            "prefill_compute_ms": m.stream_compute_seconds * 1e3,
            "bulk_transfer_ms": m.bulk_transfer_seconds * 1e3,
            "exposed_ms": m.stream_exposed_seconds * 1e3,
            "receiver_exposed_ms": m.receiver_exposed_seconds * 1e3,
            "hidden_fraction": m.hidden_fraction,
            "bulk_compute_ms": m.bulk_compute_seconds * 1e3,
            "compute_slowdown": m.compute_slowdown, "speedup": m.speedup,
            "save_layer_us_mean": statistics.fmean(m.save_layer_seconds) * 1e6,
            "save_layer_us_max": max(m.save_layer_seconds) * 1e6,
            "verified": self.verified,
            "iterations": [{**asdict(it), "hidden_fraction": it.hidden_fraction,
                            "layer_latency_ms": it.layer_latency_seconds * 1e3,
                            "compute_slowdown": it.compute_slowdown, "speedup": it.speedup}
                           for it in self.iterations],
            "wall_seconds": self.wall_seconds,
        }


class _Compute:
    """The simulated layer: ``repeats`` float32 matmuls of ``MATMUL_N`` x ``MATMUL_N``."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        self.b = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        self.out = np.empty_like(self.a)
        self.repeats = 1

    def unit_seconds(self) -> float:
        """Time of one matmul in a loop like ``layer``'s (median of batches)."""
        times = []
        for _ in range(_CALIBRATION_BATCHES):
            start = time.perf_counter()
            for _ in range(_CALIBRATION_BATCH):
                np.matmul(self.a, self.b, out=self.out)
            times.append((time.perf_counter() - start) / _CALIBRATION_BATCH)
        return statistics.median(times)

    def calibrate(self, target_seconds: float) -> None:
        self.repeats = max(1, round(target_seconds / self.unit_seconds()))

    def layer(self) -> tuple[float, float]:
        start = time.monotonic()
        for _ in range(self.repeats):
            np.matmul(self.a, self.b, out=self.out)
        return start, time.monotonic()


@dataclass(frozen=True, slots=True)
class Bulk:
    compute_seconds: float
    transfer_seconds: float
    mismatched_blocks: int


@dataclass(frozen=True, slots=True)
class Streamed:
    compute: tuple[tuple[float, float], ...]  # per layer (start, end)
    exposed_seconds: float
    save_layer_seconds: tuple[float, ...]
    transfer: tuple[tuple[float, float], ...]  # per layer (posted, landed), sender's view
    arrived: tuple[float, ...]  # per layer, at the receiver
    mismatched_blocks: int

    @property
    def compute_seconds(self) -> float:
        return self.compute[-1][1] - self.compute[0][0]


def layer_latency(transfer: tuple[tuple[float, float], ...]) -> float:
    """Median over layers of landed - posted."""
    return statistics.median(landed - posted for posted, landed in transfer)


class StreamPair:
    """This process's prefill side and a decode side in a peer process, connected, with the
    request's blocks placed and filled, and the simulated compute calibrated; ``bulk()`` and
    ``streamed()`` each hand the blocks off once and verify them. A context manager."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.layout = config.layout()
        self.num_blocks = self.layout.blocks_for(config.num_tokens)
        self.compute = _Compute(config.seed)
        self._count = 0
        self.peer = Peer(config.timeout)
        try:
            self.near = connect_pair(self.peer, self.layout, self.num_blocks,
                                     config.agent_kwargs, config.timeout)
        except BaseException:
            self.peer.stop()
            raise
        try:
            self.src = self.near.place(self.num_blocks, "allocator", config.seed)
            self.dst = self.peer.call("place", self.num_blocks, "allocator", config.seed + 1)
            self.near.fill(self.src, config.seed)
            self.compute_ms = config.compute_ms or self._calibrate()
        except BaseException:
            self.close()
            raise

    def _calibrate(self) -> float:
        """Per-layer compute: ``compute_ratio`` x the per-layer time of the faster of two
        bulk writes without compute (the first also wires UCX up)."""
        self.compute.repeats = 0
        seconds = min(self._checked(self.bulk()).transfer_seconds for _ in range(2))
        target_ms = seconds / self.layout.num_layers * 1e3 * self.config.compute_ratio
        self.compute.calibrate(target_ms / 1e3)
        return target_ms

    @staticmethod
    def _checked(bulk: Bulk) -> Bulk:
        if bulk.mismatched_blocks:
            raise BenchError(f"a bulk transfer arrived wrong in {bulk.mismatched_blocks} "
                             "(layer, block) pairs")
        return bulk

    def _tag(self, kind: str) -> str:
        self._count += 1
        return f"bench-{kind}-{self._count}"

    def bulk(self) -> Bulk:
        """Every layer's compute, then one write of all of them with a notification."""
        tag = self.prepare_bulk()
        timing = self.run_bulk(tag)
        return self.verify_bulk(tag, timing)

    def streamed(self) -> Streamed:
        """Each layer's compute then ``save_layer``; ``finish`` and ``wait_for_save``."""
        request_id = self.prepare_streamed()
        return self.verify_streamed(self.run_streamed(request_id))

    # The three steps of each hand-off, for callers that time only the middle one.

    def prepare_bulk(self) -> bytes:
        self.peer.call("wipe", self.dst)
        return self._tag("bulk").encode()

    def run_bulk(self, tag: bytes) -> tuple[float, float]:
        """(compute seconds, transfer seconds)."""
        start = time.monotonic()
        for _ in range(self.layout.num_layers):
            self.compute.layer()
        computed = time.monotonic()
        self.near.agent.write(FAR, self.src, self.dst, notify=tag).wait(self.config.timeout)
        return computed - start, time.monotonic() - computed

    def verify_bulk(self, tag: bytes, timing: tuple[float, float]) -> Bulk:
        bad = self.peer.call("check_after_notification", tag, self.dst, self.src,
                             self.config.seed, self.config.timeout)
        return Bulk(*timing, bad)

    def prepare_streamed(self) -> str:
        """Wipes the receiver's blocks and has it expect the request; returns the id."""
        request_id = self._tag("stream")
        self.peer.call("wipe", self.dst)
        self.peer.send("load", request_id, self.dst, self.src, self.config.seed,
                       self.config.timeout)
        return request_id

    def run_streamed(self, request_id: str) -> tuple[Any, list, list, float]:
        """(stream, compute spans, save_layer seconds, exposed seconds)."""
        stream = self.near.agent.stream_to(FAR, self.src, self.dst, request_id)
        spans, saves = [], []
        for layer in range(self.layout.num_layers):
            spans.append(self.compute.layer())
            start = time.perf_counter()
            stream.save_layer(layer)
            saves.append(time.perf_counter() - start)
        computed = time.monotonic()
        stream.finish(payload=b"first-token")
        stream.wait_for_save(self.config.timeout)
        return stream, spans, saves, time.monotonic() - computed

    def verify_streamed(self, run: tuple[Any, list, list, float]) -> Streamed:
        stream, spans, saves, exposed = run
        far = self.peer.reply("load")
        if far["payload"] != b"first-token":
            raise BenchError(f"the receiver got payload {far['payload']!r}, sent "
                             "b'first-token'")
        return Streamed(tuple(spans), exposed, tuple(saves),
                        tuple(tuple(t) for t in stream.layer_times()), tuple(far["arrived"]),
                        far["mismatches"])

    def close(self) -> None:
        try:
            self.near.close()
        finally:
            self.peer.stop()

    def __enter__(self) -> StreamPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _iteration(pair: StreamPair) -> Iteration:
    bulk, streamed = pair.bulk(), pair.streamed()
    last_compute = streamed.compute[-1][1]
    return Iteration(
        bulk_compute_seconds=bulk.compute_seconds, bulk_transfer_seconds=bulk.transfer_seconds,
        stream_compute_seconds=streamed.compute_seconds,
        stream_exposed_seconds=streamed.exposed_seconds,
        receiver_exposed_seconds=max(max(streamed.arrived) - last_compute, 0.0),
        save_layer_seconds=streamed.save_layer_seconds, compute=streamed.compute,
        transfer=streamed.transfer, arrived=streamed.arrived,
        mismatched_blocks=bulk.mismatched_blocks + streamed.mismatched_blocks)


def run(config: StreamConfig, progress: Progress | None = None) -> StreamReport:
    """Calibrates the compute, then measures ``1 + config.iters`` iterations.

    Raises:
        BenchError: the peer process failed, died or timed out.
        KVMoveError: a transfer failed.
    """
    progress = progress or (lambda label: None)
    wall = time.perf_counter()
    with StreamPair(config) as pair:
        progress("calibrated")
        runs = []
        for index in range(config.iters + 1):
            runs.append(_iteration(pair))
            progress(f"iteration {index}" if index else "warm-up")
    layout = pair.layout
    return StreamReport(config, layout.num_layers, pair.num_blocks,
                        pair.num_blocks * layout.bytes_per_block, pair.compute_ms,
                        pair.compute.repeats, tuple(runs[1:]), time.perf_counter() - wall,
                        runs[0])


def count_steps(config: StreamConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    return config.iters + 2
