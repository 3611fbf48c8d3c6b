"""``kvmove-bench classes``: what a concurrent offload stream does to a hand-off's latency,
with traffic classes and without, in one run (docs/transfer.md, "Traffic classes").

One prefill agent in this process streams a request's KV (``--handoff-blocks`` blocks, every
layer) into a decode agent's lease, the way a P/D hand-off does (``Agent.stream_to``: the
``"handoff"`` class), while it writes blocks to a store agent, keeping
``--offload-ratio`` times the hand-off's bytes in flight. Three modes, interleaved round by round so
that the machine's drift falls on all of them alike:

* **idle**: the hand-off alone;
* **one class**: the offload writes are ``"handoff"`` too, so every transfer takes its turn
  in posting order (what an agent without classes does);
* **classes**: the offload writes are ``"offload"``: on the mapped path the hand-off's
  chunks go first and the offload's run on idle-priority threads; over UCX the offload goes
  in windows, none while a hand-off is in flight (docs/transfer.md, "Traffic classes").

Each row: the hand-off's latency (lease to last layer loaded, checksums on as by default),
its median and ratio to idle's, and the offload's GB/s over the same span (classes must not
starve it). Every hand-off's bytes and every offload's are verified. All three agents live
in this process: on the mapped path the prefill agent's copy threads do every copy, so
peers in other processes would only wait; ``--same-host ucx`` (with ``--transports tcp``:
the link between hosts) runs the same over UCX, where the offload is paced in windows
(csrc/transport/paced_path.h).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from kvmove import _C
from kvmove.agent import Agent
from kvmove.bench.options import add_agent_args
from kvmove.bench.progress import bar
from kvmove.bench.report import BenchError
from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec
from kvmove.transfer import Transfer

__all__ = ["ClassRow", "ClassesReport", "add_parser", "format_classes", "measure",
           "run_command"]

# Llama-3.1-8B's KV (a block of one layer is 64 KiB, of every layer 2 MiB).
LAYOUT = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
MODES = ("idle", "one class", "classes")
_OFFLOAD_CLASS = {"one class": "handoff", "classes": "offload"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "classes", help="a hand-off's latency beside an offload stream, with classes and "
        "without",
        description="Streams one request's KV into a decode agent while writing 10x or more "
        "its bytes to a store agent: the hand-off's latency idle, with the offload in the same "
        "class, and with the offload in its own class. Real agents, every byte verified.")
    sub.add_argument("--handoff-blocks", type=int, default=8,
                     help="blocks of one hand-off, every layer of Llama-3.1-8B's KV (2 MiB a "
                     "block; default 8)")
    sub.add_argument("--offload-ratio", type=int, default=16,
                     help="bytes of each offload write over a hand-off's (at least 10; "
                     "default 16)")
    sub.add_argument("--iters", type=int, default=5,
                     help="rounds; each measures every mode, 3 hand-offs each (default 5)")
    sub.add_argument("--timeout", type=float, default=60.0,
                     help="deadline of every wait in seconds (default 60)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    add_agent_args(sub, "every agent")
    sub.set_defaults(run=run_command)


@dataclass(frozen=True, slots=True)
class ClassRow:
    mode: str
    latencies: list[float]  # seconds, each hand-off of the mode
    offload_bytes: int      # moved during the mode's hand-offs
    offload_seconds: float  # the span those hand-offs took

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)

    @property
    def offload_gbytes_per_s(self) -> float:
        return self.offload_bytes / self.offload_seconds / 1e9 if self.offload_seconds else 0.0


@dataclass(frozen=True, slots=True)
class ClassesReport:
    handoff_bytes: int
    offload_write_bytes: int
    path: str
    copy_threads: int
    rows: list[ClassRow]

    def row(self, mode: str) -> ClassRow:
        return next(r for r in self.rows if r.mode == mode)

    def to_dict(self) -> dict:
        idle = self.row("idle").median
        return {"handoff_bytes": self.handoff_bytes,
                "offload_write_bytes": self.offload_write_bytes, "path": self.path,
                "copy_threads": self.copy_threads,
                "rows": [{**asdict(r), "median_seconds": r.median, "vs_idle": r.median / idle,
                          "offload_gbytes_per_s": r.offload_gbytes_per_s} for r in self.rows]}


def run_command(args: argparse.Namespace) -> int:
    for flag, value, least in (("--handoff-blocks", args.handoff_blocks, 1),
                               ("--offload-ratio", args.offload_ratio, 10),
                               ("--iters", args.iters, 1)):
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout}")
    kwargs = {"transports": args.transports, "error_mode": args.error_mode,
              "same_host": args.same_host}
    with bar(args, args.iters * len(MODES)) as progress:
        report = measure(args.handoff_blocks, args.offload_ratio, args.iters, kwargs,
                         args.timeout, progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_classes(report))
    return 0


def measure(handoff_blocks: int, ratio: int, iters: int, kwargs: dict, timeout: float,
            progress: Callable[[str], None] = lambda label: None,
            per_mode: int = 3) -> ClassesReport:
    """The three modes, ``iters`` rounds of ``per_mode`` hand-offs each."""
    offload_blocks = handoff_blocks * ratio
    prefill = Agent("classes-prefill", KVCache(LAYOUT, handoff_blocks + offload_blocks),
                    **kwargs)
    decode = Agent("classes-decode", KVCache(LAYOUT, handoff_blocks), **kwargs)
    store = Agent("classes-store", KVCache(LAYOUT, offload_blocks), **kwargs)
    try:
        view = prefill.cache.numpy().view(np.uint8)
        view[...] = np.random.default_rng(1).integers(0, 256, view.shape, dtype=np.uint8)
        dec, sto = (prefill.connect(*agent.listen(), timeout=timeout) for agent in (decode, store))
        rig = _Rig(prefill, decode, store, dec, sto, handoff_blocks, offload_blocks, timeout)
        rig.handoff("warm-up")
        latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
        moved = dict.fromkeys(MODES, 0)
        spans = dict.fromkeys(MODES, 0.0)
        for round_ in range(iters):
            for mode in MODES:
                times, nbytes, span = rig.mode(mode, f"r{round_}", per_mode)
                latencies[mode] += times
                moved[mode] += nbytes
                spans[mode] += span
                progress(mode)
        rows = [ClassRow(mode, latencies[mode], moved[mode], spans[mode]) for mode in MODES]
        return ClassesReport(handoff_blocks * LAYOUT.bytes_per_block,
                             offload_blocks * LAYOUT.bytes_per_block, prefill.peer_path(dec),
                             _C.default_copy_threads(), rows)
    finally:
        for agent in (prefill, decode, store):
            agent.close()


class _Rig:
    """The three agents and the offload writer thread."""

    def __init__(self, prefill: Agent, decode: Agent, store: Agent, dec: str, sto: str,
                 handoff_blocks: int, offload_blocks: int, timeout: float) -> None:
        self.prefill, self.decode, self.store, self.dec, self.sto = (prefill, decode, store,
                                                                     dec, sto)
        self.handoff_ids = list(range(handoff_blocks))
        self.offload_src = list(range(handoff_blocks, handoff_blocks + offload_blocks))
        self.offload_dst = list(range(offload_blocks))
        self.timeout = timeout

    def handoff(self, request: str) -> float:
        """One hand-off into a fresh lease; seconds from the lease to the last layer loaded.
        Its bytes verified."""
        self.decode.cache.numpy()[...] = 0
        start = time.perf_counter()
        load = self.decode.expect(self.prefill.name, request, self.handoff_ids,
                                  timeout=self.timeout).start_load()
        stream = self.prefill.stream_to(self.dec, self.handoff_ids, self.handoff_ids, request,
                                        epoch=load.epoch)
        for layer in range(LAYOUT.num_layers):
            stream.save_layer(layer)
        stream.finish()
        load.wait_all(self.timeout)
        seconds = time.perf_counter() - start
        stream.wait_for_save(self.timeout)
        sent = self.prefill.cache.numpy().view(np.uint8)[:, :len(self.handoff_ids)]
        if not np.array_equal(self.decode.cache.numpy().view(np.uint8), sent):
            raise BenchError(f"hand-off {request}: the decode's blocks differ from the "
                             "prefill's after the load completed")
        return seconds

    def mode(self, mode: str, tag: str, count: int) -> tuple[list[float], int, float]:
        """``count`` hand-offs in ``mode``: their latencies, and the offload bytes written
        while they ran and over what span."""
        if mode == "idle":
            return [self.handoff(f"{tag}-idle-{i}") for i in range(count)], 0, 0.0
        writer = _Writer(self, _OFFLOAD_CLASS[mode])
        writer.start()
        try:
            time.sleep(0.05)  # the offload stream under way first
            before, start = writer.written, time.perf_counter()
            times = [self.handoff(f"{tag}-{mode}-{i}") for i in range(count)]
            nbytes, span = writer.written - before, time.perf_counter() - start
        finally:
            writer.stop()
        self._verify_offload()
        return times, nbytes, span

    def _verify_offload(self) -> None:
        sent = self.prefill.cache.numpy().view(np.uint8)[:, self.offload_src[0]:]
        if not np.array_equal(self.store.cache.numpy().view(np.uint8), sent):
            raise BenchError("the store's blocks differ from the prefill's after the offload "
                             "writes completed")


class _Writer:
    """Keeps the offload stream going until stopped: ``ratio`` writes in flight, each of a
    hand-off's bytes (a slice of the offload blocks each), the next posted as one completes;
    counts the bytes of each write that completed."""

    def __init__(self, rig: _Rig, traffic: str) -> None:
        self.rig, self.traffic = rig, traffic
        self.written = 0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="classes-offload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.rig.timeout)
        if self._thread.is_alive():
            raise BenchError("the offload writer did not stop in time")
        if self.failure is not None:
            raise BenchError(f"an offload write failed: {self.failure}")

    def _run(self) -> None:
        rig = self.rig
        size = len(rig.handoff_ids)
        slices = [(rig.offload_src[i:i + size], rig.offload_dst[i:i + size])
                  for i in range(0, len(rig.offload_src), size)]
        nbytes = size * LAYOUT.bytes_per_block
        try:
            flight = deque(self._post(*piece) for piece in slices)
            turn = 0
            while flight:
                flight.popleft().wait(rig.timeout)
                self.written += nbytes
                if not self._stop.is_set():
                    flight.append(self._post(*slices[turn]))
                    turn = (turn + 1) % len(slices)
        except Exception as error:  # noqa: BLE001 - reported by stop()
            self.failure = error

    def _post(self, src: list[int], dst: list[int]) -> Transfer:
        return self.rig.prefill.write(self.rig.sto, src, dst, traffic=self.traffic)


def format_classes(report: ClassesReport) -> str:
    mib = 1 << 20
    idle = report.row("idle").median
    lines = [f"A hand-off of {report.handoff_bytes / mib:.0f} MiB (Llama-3.1-8B KV, every "
             f"layer, checksums on) beside offload writes keeping "
             f"{report.offload_write_bytes / mib:.0f} MiB in flight; path: {report.path}, "
             f"{report.copy_threads} copy threads",
             "", "| mode | hand-off, median | range | vs idle | offload GB/s meanwhile |",
             "|---|---|---|---|---|"]
    for row in report.rows:
        offload = "-" if row.mode == "idle" else f"{row.offload_gbytes_per_s:.2f}"
        lines.append(f"| {row.mode} | {row.median * 1e3:.2f} ms | "
                     f"{min(row.latencies) * 1e3:.2f}-{max(row.latencies) * 1e3:.2f} ms | "
                     f"{row.median / idle:.2f}x | {offload} |")
    lines += ["", "With classes the offload's copies run on idle-priority threads and give way "
              "to the hand-off's" if report.path == "mapped" else
              "With classes the offload goes in 1 MiB windows, none posted while a hand-off "
              "is under way"]
    return "\n".join(lines)
