"""``kvmove-bench stream``: whether layer-wise streaming makes the prefill-plus-hand-off end
sooner than handing the KV off in bulk after the prefill; the subcommand prints
``stream_report``'s text of it, or its JSON.

A simulated prefill runs here. Per layer, ``--compute cpu`` (the default) runs a real float32
matmul repeated to take ``compute_ms`` (by default the measured per-layer transfer time times
``compute_ratio``) on one of this host's cores; ``--compute accelerator`` waits that long
instead (a timed wait standing in for an accelerator's kernels: the host's cores stay free).
Then the layer's KV counts as written. A peer process is the decode side. Per iteration, two
hand-offs of the same blocks through the same stream API, with the same checksums, every byte
verified on the receiving side:

* **bulk**: compute every layer, then ``save_layer`` every layer, ``finish`` and
  ``wait_for_save``: the baseline, its transfer fully exposed.
* **stream**: ``save_layer(i)`` after each layer's compute, then ``finish`` and
  ``wait_for_save`` (the receiver's acknowledgement of the final message).

With checksums on (the default, as ``kvmove.Agent``), a third hand-off streams without them:
what they cost, in the same run.

The headline is the **end-to-end speedup**: (bulk compute + bulk transfer) over (streamed
compute + what is left after it), the time until the decode has the KV. ``exposed`` is the
time from the end of the last layer's compute until the hand-off is done, and the **hidden
fraction** is ``1 - exposed_stream / exposed_bulk``: it says how much of the transfer streaming
overlapped, not whether that paid (on a host whose cores the compute needs, the overlap can
slow the compute down by more than it hides). The sender's clock decides; the receiver's
arrival times (same host, same monotonic clock) are reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmove.bench.options import add_agent_args, add_output_args, add_prompt_args, check_plot
from kvmove.bench.peer import FAR, Peer, connect_pair
from kvmove.bench.progress import Progress, bar
from kvmove.bench.report import BenchError
from kvmove.bench.stream_report import (
    COMPUTE_KINDS,
    MATMUL_N,
    Iteration,
    StreamConfig,
    StreamReport,
    format_stream,
    plot_stream,
)

__all__ = ["Bulk", "StreamPair", "Streamed", "add_parser", "count_steps", "run", "run_command"]

_CALIBRATION_BATCHES = 7
_CALIBRATION_BATCH = 100


class _Compute:
    """The simulated layer: ``repeats`` float32 matmuls of ``MATMUL_N`` x ``MATMUL_N`` on
    this host's CPU, or (``accelerator``) a timed wait as long as they would take."""

    def __init__(self, seed: int, accelerator: bool = False) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        self.b = rng.standard_normal((MATMUL_N, MATMUL_N), dtype=np.float32)
        self.out = np.empty_like(self.a)
        self.repeats = 1
        self.accelerator = accelerator
        self.wait_seconds = 0.0  # accelerator: a layer's wait

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
        if self.accelerator:
            self.wait_seconds = target_seconds
        else:
            self.repeats = max(1, round(target_seconds / self.unit_seconds()))

    def layer(self) -> tuple[float, float]:
        start = time.monotonic()
        if self.accelerator:  # asleep, as a thread blocked on a device event (no core used)
            end = start + self.wait_seconds
            while (left := end - time.monotonic()) > 0:
                time.sleep(left)
        else:
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


class StreamPair:
    """This process's prefill side and a decode side in a peer process, connected, with the
    request's blocks placed and filled, and the simulated compute calibrated; ``bulk()`` and
    ``streamed()`` each hand the blocks off once and verify them. A context manager."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.layout = config.layout()
        self.num_blocks = self.layout.blocks_for(config.num_tokens)
        self.compute = _Compute(config.seed, config.compute == "accelerator")
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
        """Per-layer compute: ``compute_ratio`` x the per-layer time of the median of three
        bulk hand-offs without compute, after one that wires UCX up (the fastest one made
        the compute short of the ratio asked: the timed bulk hand-offs run slower)."""
        self.compute.repeats = 0
        self._checked(self.bulk())
        seconds = statistics.median(self._checked(self.bulk()).transfer_seconds
                                    for _ in range(3))
        return self.recalibrate(seconds)

    def recalibrate(self, bulk_transfer_seconds: float) -> float:
        """Sizes the per-layer compute to ``compute_ratio`` x this bulk transfer's per-layer
        time (unless ``compute_ms`` fixes it); returns the compute in ms. ``run`` calls it
        again with the warm-up's bulk transfer, which, run after a compute like the timed
        ones, is slower than the calibration's back-to-back hand-offs."""
        if self.config.compute_ms is not None:
            return self.config.compute_ms
        target_ms = (bulk_transfer_seconds / self.layout.num_layers * 1e3 *
                     self.config.compute_ratio)
        self.compute.calibrate(target_ms / 1e3)
        self.compute_ms = target_ms
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
        """Every layer's compute, then every layer saved, ``finish`` and ``wait_for_save``."""
        lease = self.prepare_bulk()
        return self.verify_bulk(lease, self.run_bulk(lease))

    def streamed(self, checksums: bool | None = None) -> Streamed:
        """Each layer's compute then ``save_layer``; ``finish`` and ``wait_for_save``.
        ``checksums``: the stream's (default: the config's)."""
        return self.verify_streamed(self.run_streamed(self.prepare_streamed(), checksums))

    # The three steps of each hand-off, for callers that time only the middle one.

    def prepare_bulk(self) -> tuple[str, int]:
        return self.prepare_streamed()

    def run_bulk(self, lease: tuple[str, int]) -> tuple[float, float]:
        """(compute seconds, transfer seconds)."""
        start = time.monotonic()
        for _ in range(self.layout.num_layers):
            self.compute.layer()
        computed = time.monotonic()
        stream = self.open_stream(lease)
        for layer in range(self.layout.num_layers):
            stream.save_layer(layer)
        stream.finish(payload=b"first-token")
        stream.wait_for_save(self.config.timeout)
        return computed - start, time.monotonic() - computed

    def verify_bulk(self, lease: tuple[str, int], timing: tuple[float, float]) -> Bulk:
        return Bulk(*timing, self._received()["mismatches"])

    def prepare_streamed(self) -> tuple[str, int]:
        """Wipes the receiver's blocks and has it lease them for a request; returns the
        request id and the lease's epoch."""
        request_id = self._tag("stream")
        self.peer.call("wipe", self.dst)
        epoch = self.peer.call("lease", request_id, self.dst, self.config.timeout)
        self.peer.send("load", request_id, self.dst, self.src, self.config.seed,
                       self.config.timeout)
        return request_id, epoch

    def open_stream(self, lease: tuple[str, int], checksums: bool | None = None) -> Any:
        """The sender's stream into a ``prepare_streamed`` lease."""
        request_id, epoch = lease
        return self.near.agent.stream_to(
            FAR, self.src, self.dst, request_id, epoch=epoch,
            checksums=self.config.checksums if checksums is None else checksums)

    def run_streamed(self, lease: tuple[str, int],
                     checksums: bool | None = None) -> tuple[Any, list, list, float]:
        """(stream, compute spans, save_layer seconds, exposed seconds)."""
        stream = self.open_stream(lease, checksums)
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

    def _received(self) -> dict[str, Any]:
        far = self.peer.reply("load")
        if far["payload"] != b"first-token":
            raise BenchError(f"the receiver got payload {far['payload']!r}, sent "
                             "b'first-token'")
        return far

    def verify_streamed(self, run: tuple[Any, list, list, float]) -> Streamed:
        stream, spans, saves, exposed = run
        far = self._received()
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
    plain = pair.streamed(checksums=False) if pair.config.checksums else None
    last_compute = streamed.compute[-1][1]
    return Iteration(
        plain_done_seconds=None if plain is None else plain.compute_seconds +
        plain.exposed_seconds,
        plain_mismatched_blocks=0 if plain is None else plain.mismatched_blocks,
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
            if index == 0:
                pair.recalibrate(runs[0].bulk_transfer_seconds)
            progress(f"iteration {index}" if index else "warm-up")
    layout = pair.layout
    return StreamReport(config, layout.num_layers, pair.num_blocks,
                        pair.num_blocks * layout.bytes_per_block, pair.compute_ms,
                        pair.compute.repeats, tuple(runs[1:]), time.perf_counter() - wall,
                        runs[0])


def count_steps(config: StreamConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    return config.iters + 2


# --- the subcommand -------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "stream", help="how much of the hand-off layer-wise streaming hides behind prefill",
        description="Runs a simulated prefill here (per layer, float32 matmuls timed to a "
        "chosen multiple of the layer's measured transfer time) and hands the KV to a peer "
        "process twice: in bulk after the last layer, and streamed with save_layer() after "
        "each. Reports the end-to-end speedup (prefill plus hand-off, bulk over streamed), "
        "the transfer left exposed after the compute, the hidden fraction (1 - exposed / "
        "bulk transfer) and what checksums cost; every byte verified on the receiving side.")
    add_prompt_args(sub)
    add_agent_args(sub, "both agents")
    sub.add_argument("--compute-ratio", type=float, default=1.0,
                     help="per-layer compute as a multiple of the per-layer transfer time "
                     "measured first (default 1.0: equal)")
    sub.add_argument("--compute-ms", type=float, default=None,
                     help="per-layer compute in ms, fixed (overrides --compute-ratio)")
    sub.add_argument("--compute", choices=COMPUTE_KINDS, default="cpu",
                     help="the simulated prefill: 'cpu' runs matmuls on one of this host's "
                     "cores; 'accelerator' waits as long instead (a timed wait standing in for "
                     "an accelerator's kernels: the host's cores stay free) (default cpu)")
    sub.add_argument("--no-checksums", dest="checksums", action="store_false",
                     help="hand off without per-block checksums (default: with them, as "
                     "kvmove.Agent, plus one streamed hand-off without them per iteration to "
                     "show what they cost)")
    add_output_args(sub, "timed iterations, after one warm-up; the median is shown",
                    "also draw the timeline of compute and transfer per layer (needs "
                    "matplotlib)")
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    config = StreamConfig(
        model=args.model, num_tokens=args.tokens, block_size=args.block_size,
        transports=args.transports, error_mode=args.error_mode,
        compute=args.compute, compute_ratio=args.compute_ratio, compute_ms=args.compute_ms,
        iters=args.iters, timeout=args.timeout, checksums=args.checksums)
    if args.plot:
        check_plot(args.plot)
    with bar(args, count_steps(config)) as progress:
        report = run(config, progress)
    if args.plot:
        plot_stream(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_stream(report))
    if not report.verified:
        print("kvmove-bench stream: error: bytes arrived wrong on the receiving side",
              file=sys.stderr)
        return 1
    return 0
