"""``kvmove-bench store``: what the KVStore's tiers move per second, against the machine's own
baselines, and what a stored prefix saves a repeated prompt; the subcommand prints the text of
it below, or ``StoreReport.to_dict()`` as JSON.

Tiers (one prompt's KV, e.g. Llama-3.1-8B x 4,000 tokens = 524 MB, ``iters`` timed runs
each, after one warm-up; every run stores new hashes, so every put really writes):

* host tier ``put`` / ``get`` against ``memcpy`` of the same bytes (numpy ``copyto``);
* disk tier ``put`` (O_DIRECT writes plus the index journal) / ``get`` (O_DIRECT reads and
  checksums) against ``dd`` (``oflag=direct`` / ``iflag=direct``, 16 MiB blocks) and a plain
  file (``write`` + ``fsync``; ``read`` after dropping the file from the page cache with
  ``posix_fadvise(DONTNEED)``), all in the same directory. The cold read alternates with the
  tier's gets, one after each: a shared virtual disk's speed drifts 2x within seconds, and
  alternating moves both alike.

Time to first token of a repeated prompt, with the engine (``MODEL_PRESETS`` model, random
weights, one request, whole-prompt prefill): **recompute** (no store), **host hit** and
**disk hit** (a fresh engine, so an empty live cache, over a store that one earlier run
filled; the disk store is reopened from its directory, so the hit is served from disk). Then
the store's load-or-recompute decision for that prompt, from its measured read bandwidth and
the engine's measured prefill throughput, and whether it picked the faster option.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvmove.bench.options import add_prompt_args
from kvmove.bench.progress import Progress, bar
from kvmove.bench.report import aligned, human_bytes, ms
from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import DTYPE_BYTES, KVSpec
from kvmove.store import DiskTier, HostTier, KVStore
from kvmove.validation import require_positive_int

__all__ = ["StoreBenchConfig", "StoreReport", "TierRow", "TtftRow", "add_parser", "count_steps",
           "format_store", "run", "run_command"]

_DD_BLOCK = 16 << 20
_WAIT = 600.0


@dataclass(frozen=True, slots=True)
class StoreBenchConfig:
    """What ``run`` measures; ``directory``: where the disk tier and baselines write (None: a
    temporary directory under the system's, removed afterwards)."""

    model: str = "llama-3.1-8b"
    tokens: int = 4000
    block_size: int = 16
    dtype: str = "float16"
    iters: int = 3
    directory: str | None = None
    engine_model: str | None = "small"   # None: skip the TTFT part
    prompt_tokens: int = 2000

    def __post_init__(self) -> None:
        for name in ("tokens", "block_size", "iters", "prompt_tokens"):
            require_positive_int(name, getattr(self, name))
        if self.tokens < self.block_size:
            raise ConfigError(f"tokens must hold at least one block of {self.block_size}, "
                              f"got {self.tokens}")

    @property
    def layout(self) -> KVSpec:
        return KVSpec.preset(self.model, dtype=self.dtype, block_size=self.block_size)


@dataclass(frozen=True, slots=True)
class TierRow:
    """One tier and direction against its baseline: seconds of each timed run."""

    tier: str            # "host" or "disk"
    op: str              # "write" or "read"
    seconds: tuple[float, ...]
    baseline: str
    baseline_seconds: tuple[float, ...]
    nbytes: int
    other_baseline: str | None = None
    other_seconds: tuple[float, ...] = ()

    def gbps(self, seconds: tuple[float, ...] | None = None) -> float:
        return self.nbytes / statistics.median(seconds or self.seconds) / 1e9

    @property
    def ratio(self) -> float:
        """The tier's bandwidth over the baseline's (medians)."""
        return self.gbps() / self.gbps(self.baseline_seconds)

    @property
    def other_ratio(self) -> float | None:
        """The tier's bandwidth over the other baseline's (medians); None without one."""
        return self.gbps() / self.gbps(self.other_seconds) if self.other_seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps(), "baseline_gbps": self.gbps(
            self.baseline_seconds), "ratio": self.ratio, "other_gbps": self.gbps(
            self.other_seconds) if self.other_seconds else None,
            "other_ratio": self.other_ratio}


@dataclass(frozen=True, slots=True)
class TtftRow:
    """One way of serving the repeated prompt: its TTFTs, and what the store decided."""

    case: str                 # "recompute", "host hit", "disk hit"
    seconds: tuple[float, ...]
    loaded_tokens: int
    decision: str | None = None
    load_seconds: float | None = None        # the decision's estimates
    recompute_seconds: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class StoreReport:
    config: StoreBenchConfig
    nbytes: int
    direct: bool                          # the disk tier used O_DIRECT
    tiers: list[TierRow]
    ttft: list[TtftRow] = field(default_factory=list)
    wall_seconds: float = 0.0

    def picked_faster(self, row: TtftRow) -> bool:
        """The decision for a hit agrees with what was measured: load when the hit's TTFT
        beat recomputing, recompute otherwise."""
        recompute = next(r for r in self.ttft if r.case == "recompute")
        return (row.decision in ("load", "partial")) == (row.median < recompute.median)

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "nbytes": self.nbytes, "direct": self.direct,
                "tiers": [r.to_dict() for r in self.tiers],
                "ttft": [{**asdict(r), "median": r.median,
                          "picked_faster": None if r.decision is None else self.picked_faster(r)}
                         for r in self.ttft],
                "wall_seconds": self.wall_seconds}


def run(config: StoreBenchConfig, progress: Progress = lambda _: None) -> StoreReport:
    """The tiers, then (with ``engine_model``) the TTFT rows; ``progress(label)`` after each
    of ``count_steps(config)`` steps."""
    start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="kvmove-bench-store-", dir=config.directory)
    try:
        report = _measure_tiers(config, root, progress)
        if config.engine_model is not None:
            report.ttft = _measure_ttft(config, root)
            progress("time to first token")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report.wall_seconds = time.perf_counter() - start
    return report


# --- tiers ------------------------------------------------------------------------------------

def count_steps(config: StoreBenchConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    return 4 + (config.engine_model is not None)


def _measure_tiers(config: StoreBenchConfig, root: str, progress: Progress) -> StoreReport:
    layout = config.layout
    n = layout.blocks_for(config.tokens)
    src, dst = KVCache(layout, n), KVCache(layout, n)
    _fill(src)
    nbytes = n * layout.bytes_per_block
    ids = list(range(n))
    rows = []
    with KVStore(layout, [HostTier(nbytes)]) as store:
        put, get, _ = _time_store(store, src, dst, ids, config.iters)
        copy = _time(lambda: np.copyto(_bytes(dst), _bytes(src)), config.iters)
        rows += [TierRow("host", "write", put, "memcpy", copy, nbytes),
                 TierRow("host", "read", get, "memcpy", copy, nbytes)]
    _check_equal(src, dst)
    progress("host tier")
    path = os.path.join(root, "baseline.dat")
    _file_write(path, _bytes(src))
    with KVStore(layout, [DiskTier(os.path.join(root, "tier"), nbytes)]) as store:
        direct = store._tiers[0].file.direct
        put, get, file_read = _time_store(store, src, dst, ids, config.iters,
                                          lambda: _file_read(path, _bytes(dst)))
    _check_equal(src, dst)
    progress("disk tier")
    dd_write = _time(lambda: _dd(f"if=/dev/zero of={path} oflag=direct", nbytes), config.iters)
    dd_read = _time(lambda: _dd(f"if={path} of=/dev/null iflag=direct", nbytes), config.iters)
    progress("dd")
    file_write = _time(lambda: _file_write(path, _bytes(src)), config.iters)
    progress("plain file")
    rows += [TierRow("disk", "write", put, "dd oflag=direct", dd_write, nbytes,
                     "write+fsync", file_write),
             TierRow("disk", "read", get, "dd iflag=direct", dd_read, nbytes,
                     "read, cold", file_read)]
    return StoreReport(config, nbytes, direct, rows)


def _time_store(store: KVStore, src: KVCache, dst: KVCache, ids: list[int], iters: int,
                after_get: Callable[[], Any] | None = None
                ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Each run puts ``ids`` under new hashes (so it writes), gets them back, then runs
    ``after_get`` (a baseline timed alongside the get); the seconds of each, per run."""
    puts, gets, afters = [], [], []
    for i in range(iters + 1):
        hashes = [(i << 32) + b + 1 for b in ids]
        t0 = time.perf_counter()
        stored = store.put(hashes, src, ids).wait(_WAIT)
        t1 = time.perf_counter()
        got = store.get(hashes, dst, ids).wait(_WAIT)
        t2 = time.perf_counter()
        if after_get is not None:
            after_get()
        t3 = time.perf_counter()
        if stored != len(ids) or got != len(ids):
            raise ConfigError(f"the store kept {stored} and returned {got} of {len(ids)} blocks")
        if i:  # the first run is the warm-up
            puts.append(t1 - t0)
            gets.append(t2 - t1)
            afters.append(t3 - t2)
    return tuple(puts), tuple(gets), tuple(afters)


def _time(fn: Callable[[], Any], iters: int) -> tuple[float, ...]:
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return tuple(out)


def _bytes(cache: KVCache) -> np.ndarray:
    return np.asarray(cache.region)


def _fill(cache: KVCache) -> None:
    """Random bytes (a 16 MiB random tile repeated: generating 500 MB would take seconds)."""
    out = _bytes(cache)
    tile = np.random.default_rng(0).integers(0, 256, min(out.size, 16 << 20), dtype=np.uint8)
    for start in range(0, out.size, tile.size):
        chunk = out[start:start + tile.size]
        chunk[:] = tile[:chunk.size]


def _check_equal(src: KVCache, dst: KVCache) -> None:
    if not np.array_equal(_bytes(src), _bytes(dst)):
        raise ConfigError("the blocks read back differ from those written")


def _dd(operands: str, nbytes: int) -> None:
    count = -(-nbytes // _DD_BLOCK)
    subprocess.run(["dd", *operands.split(), f"bs={_DD_BLOCK}", f"count={count}",
                    "status=none"], check=True)


def _file_write(path: str, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(data.data)  # the array's memoryview (numpy types ndarray a Buffer from 3.12)
        f.flush()
        os.fsync(f.fileno())


def _file_read(path: str, out: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the cache
        view, done = out.data, 0  # memoryview(out), as typeshed sees it on 3.11
        while done < out.size:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                break
            done += n
    finally:
        os.close(fd)


# --- time to first token ----------------------------------------------------------------------

def _measure_ttft(config: StoreBenchConfig, root: str) -> list[TtftRow]:
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
    from kvmove.engine.worker import EngineWorker

    assert config.engine_model is not None  # run() skips the TTFT part without a model
    model_config = MODEL_PRESETS[config.engine_model]
    model = LlamaForCausalLM.random(model_config, seed=0)
    layout = model_config.kv_spec(config.block_size)
    rng = random.Random(0)
    prompt = [rng.randrange(3, model_config.vocab_size) for _ in range(config.prompt_tokens)]
    num_blocks = layout.blocks_for(config.prompt_tokens) + 8

    def ttft(store: KVStore | None) -> tuple[float, int]:
        from kvmove.engine.request import Request, SamplingParams
        from kvmove.engine.scheduler import SchedulerConfig

        worker = EngineWorker(model, num_blocks=num_blocks, block_size=config.block_size,
                              scheduler=SchedulerConfig(
                                  chunk_size=None, max_num_batched_tokens=config.prompt_tokens),
                              store=store)
        request = Request("r", prompt, SamplingParams(max_tokens=1))
        worker.add_request(request)
        worker.run()
        worker.close()  # waits for its offer to the store
        ttft = request.timings.ttft
        assert ttft is not None  # run() returned: its one token came
        return ttft, request.num_stored

    rows = [TtftRow("recompute", tuple(ttft(None)[0] for _ in range(config.iters)), 0)]
    host = HostTier(num_blocks * layout.bytes_per_block)
    disk_dir = os.path.join(root, "ttft")
    disk = DiskTier(disk_dir, num_blocks * -(-layout.bytes_per_block // 4096) * 4096)
    for case, tiers in (("host hit", [host]), ("disk hit", [disk])):
        store = KVStore(layout, tiers)
        try:
            ttft(store)  # fills the store, and reports the prefill's throughput to it
            if case == "disk hit":  # reopened: the hit comes from the disk, the index persisted
                prefill_tps = store.stats().prefill_tokens_per_second
                assert prefill_tps is not None  # the first ttft(store) reported it
                store.close()
                store = KVStore(layout, tiers)
                store.observe_prefill(config.prompt_tokens, config.prompt_tokens / prefill_tps)
            runs = [ttft(store) for _ in range(config.iters)]
            lookup = store.lookup(_prompt_hashes(prompt, config.block_size))
        finally:
            store.close()
        rows.append(TtftRow(case, tuple(t for t, _ in runs), runs[-1][1], lookup.decision,
                            lookup.load_seconds, lookup.recompute_seconds))
    return rows


def _prompt_hashes(prompt: list[int], block_size: int) -> list[int]:
    from kvmove import block_hashes

    usable = (len(prompt) - 1) // block_size  # the engine always computes the last token
    return list(block_hashes(prompt[:usable * block_size], block_size))


# --- text -------------------------------------------------------------------------------------

def format_store(report: StoreReport) -> str:
    """Header, the tier table, the TTFT table with the store's decisions."""
    config = report.config
    lines = [f"{config.model} KV of {config.tokens:,} tokens ({config.dtype}, blocks of "
             f"{config.block_size}): {human_bytes(report.nbytes)}; disk tier "
             f"{'O_DIRECT' if report.direct else 'buffered (O_DIRECT refused here)'}; median "
             f"of {config.iters} runs after a warm-up", "", *_tier_table(report.tiers)]
    if report.ttft:
        lines += ["", f"time to first token of a repeated {config.prompt_tokens:,}-token prompt "
                  f"({config.engine_model} engine, one request, fresh engine each run)",
                  *_ttft_table(report)]
    return "\n".join([*lines, "", f"measured in {report.wall_seconds:.1f} s"])


def _tier_table(rows: list[TierRow]) -> list[str]:
    head = ["tier", "op", "GB/s", "baseline", "GB/s", "tier/baseline", "also", "GB/s",
            "tier/also"]
    cells = [[r.tier, r.op, f"{r.gbps():.2f}", r.baseline, f"{r.gbps(r.baseline_seconds):.2f}",
              f"{r.ratio:.2f}x", r.other_baseline or "",
              f"{r.gbps(r.other_seconds):.2f}" if r.other_seconds else "",
              f"{r.other_ratio:.2f}x" if r.other_ratio else ""] for r in rows]
    return aligned(head, cells, left={0, 1, 3, 6})


def _ttft_table(report: StoreReport) -> list[str]:
    recompute = next(r for r in report.ttft if r.case == "recompute").median
    head = ["case", "TTFT ms", "vs recompute", "tokens loaded", "decision", "est. load ms",
            "est. recompute ms", "picked the faster"]
    return aligned(head, [_ttft_cells(report, r, recompute) for r in report.ttft],
                    left={0, 4})


def _ttft_cells(report: StoreReport, row: TtftRow, recompute: float) -> list[str]:
    def millis(seconds: float | None) -> str:
        return "" if seconds is None else ms(seconds * 1e3)

    picked = "" if row.decision is None else ("yes" if report.picked_faster(row) else "NO")
    return [row.case, millis(row.median), f"{recompute / row.median:.1f}x faster" if
            row.case != "recompute" else "", f"{row.loaded_tokens:,}", row.decision or "",
            millis(row.load_seconds), millis(row.recompute_seconds), picked]


# --- the subcommand ---------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "store", help="KVStore tiers vs memcpy/dd, and TTFT of a stored prefix",
        description="Writes one prompt's KV into the KVStore's host and disk tiers and reads it "
        "back (every byte checked), against memcpy, dd (O_DIRECT) and a plain file in the same "
        "run; then the time to first token of a repeated prompt when recomputed, loaded from "
        "the host tier and loaded from the disk tier, and whether the store's "
        "load-or-recompute decision picked the faster (the TTFT part needs torch).")
    add_prompt_args(sub)
    sub.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float16",
                     help="KV element type (default float16)")
    sub.add_argument("--dir", default=None, help="where the disk tier and the baselines write "
                     "(default: a temporary directory, removed afterwards)")
    sub.add_argument("--engine-model", default="small",
                     help="engine preset for the TTFT rows (default small)")
    sub.add_argument("--prompt-tokens", type=int, default=2000,
                     help="the repeated prompt's length (default 2000)")
    sub.add_argument("--no-ttft", action="store_true", help="tiers only (no torch needed)")
    sub.add_argument("--iters", type=int, default=3,
                     help="timed runs per row after a warm-up; the median is shown (default 3)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    if args.dir is not None and not os.path.isdir(args.dir):
        raise ConfigError(f"--dir {args.dir!r} is not a directory")
    if not args.no_ttft:
        try:
            from kvmove.engine.model import MODEL_PRESETS
        except ImportError as error:
            raise ConfigError(f"the TTFT rows need the engine's dependencies: pip install "
                              f"kvmove[engine], or pass --no-ttft ({error})") from None
        if args.engine_model not in MODEL_PRESETS:
            raise ConfigError(f"--engine-model must be one of {list(MODEL_PRESETS)}, got "
                              f"{args.engine_model!r}")
    config = StoreBenchConfig(
        model=args.model, tokens=args.tokens, block_size=args.block_size, dtype=args.dtype,
        iters=args.iters, directory=args.dir,
        engine_model=None if args.no_ttft else args.engine_model,
        prompt_tokens=args.prompt_tokens)
    with bar(args, count_steps(config)) as progress:
        report = run(config, progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_store(report))
    return 0
