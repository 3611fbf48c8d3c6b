"""``kvmove-bench transfer``'s measurements: real transfers between two processes, and the
baselines they are compared against, all from the same run. No printing: the CLI formats.

The far side is a spawned process with its own ``KVCache`` and ``Agent``, driven over a
``multiprocessing`` Pipe: every reply has a deadline, and a dead peer is noticed within 50 ms.
For each block size and placement the bench:

1. places ``blocks_for(num_tokens)`` blocks in each cache, which holds ``spare_factor`` times
   that many (``allocator``: ``pool.allocate(n)``, one contiguous run in a fresh pool;
   ``scatter``: random distinct ids over the whole cache in random order, the worst case,
   where almost nothing coalesces);
2. WRITE: fills the local blocks with a seeded pattern; per iteration wipes the remote blocks,
   times ``write(..., notify=tag)`` + ``wait()``, and has the peer wait for the notification
   and compare every byte of its blocks with the pattern;
3. READ: the same with the roles swapped (the peer fills, we wipe, read and compare).

Verification recomputes the pattern instead of hashing both sides: it checks every byte
exactly, needs no hash library, runs at memory speed and counts the (layer, block) pairs
that are wrong. The pattern of (seed, layer, source block id) is one random word string
XORed with a per-(layer, block) key, so data landing in the wrong block or layer fails too.

Iteration 0 is an untimed warm-up (UCX wires endpoints up and unpacks keys on first use);
a row reports the *best* of the ``iters`` timed iterations, since on a shared machine noise
only ever slows a run down. Every iteration, the warm-up included, is verified.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvmove import perftest
from kvmove.agent import ERROR_MODES, Agent
from kvmove.errors import ConfigError, KVMoveError
from kvmove.kv_cache import KVCache
from kvmove.layout import PRESETS, KVLayout
from kvmove.plan import DEFAULT_LINKS, transfer_ms

__all__ = ["BenchConfig", "BenchError", "BenchReport", "PLACEMENTS", "SWEEP_BLOCK_SIZES",
           "RoundTrip", "TransferRow", "count_steps", "memcpy_gbytes_per_s", "run"]

PLACEMENTS = ("allocator", "scatter")
SWEEP_BLOCK_SIZES = (16, 32, 64, 128)
_NEAR, _FAR = "bench-near", "bench-far"
_WIPE = np.uint64(0xA5A5A5A5A5A5A5A5)
_PEER_IDLE_SECONDS = 600.0  # a peer without commands this long assumes we are gone
_ROUND_TRIP_WARMUP = 20
_PERFTEST_TEST = {"write": "ucp_put_bw", "read": "ucp_get"}

Progress = Callable[[str], None]


class BenchError(KVMoveError):
    """The benchmark's peer process failed, died, or did not answer in time."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What ``run`` measures.

    Args:
        model: a ``KVLayout`` preset.
        num_tokens: prompt length; ``blocks_for(num_tokens)`` whole blocks move.
        block_sizes: tokens per block, one set of rows each (``SWEEP_BLOCK_SIZES`` sweeps).
        placements: subset of ``PLACEMENTS``.
        transports: UCX transport list for both agents and ``ucx_perftest`` (None: UCX's).
        error_mode: the agents' ``error_mode``; ``"peer"`` also runs ``ucx_perftest -e``.
        iters: timed iterations per row (plus one warm-up); the best is reported.
        spare_factor: each cache holds this many times the blocks moved.
        round_trips: timed one-block write + notification ping-pongs.
        perftest_sizes: extra ``ucp_put_bw`` message sizes (the rows' op sizes always run).
        timeout: deadline in seconds of every wait (transfer, peer reply, ucx_perftest).
        seed: for the data pattern and the scattered placement.
    """

    model: str = "llama-3.1-8b"
    num_tokens: int = 4000
    block_sizes: tuple[int, ...] = (16,)
    placements: tuple[str, ...] = ("allocator",)
    transports: str | None = None
    error_mode: str = "peer"
    iters: int = 3
    spare_factor: int = 2
    round_trips: int = 200
    perftest_sizes: tuple[int, ...] = ()
    timeout: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_tokens", "iters", "spare_factor", "round_trips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not self.block_sizes:
            raise ConfigError("block_sizes must hold at least one block size, got none")
        for block_size in self.block_sizes:
            self.layout(block_size)  # validates model and block_size
        if not self.placements or set(self.placements) - set(PLACEMENTS):
            raise ConfigError(f"placements must be some of {PLACEMENTS}, got {self.placements}")
        if self.error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        if self.transports is not None and not self.transports.strip():
            raise ConfigError(f"transports must be a UCX transport list or None, got "
                              f"{self.transports!r}")
        if any(size <= 0 for size in self.perftest_sizes):
            raise ConfigError(f"perftest_sizes must be positive, got {self.perftest_sizes}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout!r}")

    def layout(self, block_size: int) -> KVLayout:
        return KVLayout.preset(self.model, block_size=block_size)

    @property
    def agent_kwargs(self) -> dict[str, Any]:
        return {"transports": self.transports, "error_mode": self.error_mode}


@dataclass(frozen=True, slots=True)
class TransferRow:
    """One configuration's best timed iteration. Seconds are wall time from the ``write`` or
    ``read`` call until ``wait`` returned; ``post_seconds`` is the part spent posting."""

    op: str
    placement: str
    block_size: int
    nbytes: int
    num_blocks: int
    num_ops: int
    post_seconds: float
    total_seconds: float
    complete_seconds: float
    iter_seconds: tuple[float, ...]
    warmup_seconds: float
    mismatched_blocks: int

    @property
    def verified(self) -> bool:
        return self.mismatched_blocks == 0

    @property
    def op_nbytes(self) -> int:
        """Mean bytes per posted operation (one coalesced run of one or more layers)."""
        return self.nbytes // self.num_ops

    @property
    def gbytes_per_s(self) -> float:
        return self.nbytes / self.total_seconds / 1e9

    @property
    def post_share_pct(self) -> float:
        return self.post_seconds / self.total_seconds * 100.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verified": self.verified, "op_nbytes": self.op_nbytes,
                "gbytes_per_s": self.gbytes_per_s, "post_share_pct": self.post_share_pct}


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """One block of one layer written with a notification, answered the same way.

    ``one_way_us`` is half the median round trip, as ``ucp_put_lat`` reports its ping-pong.
    """

    nbytes: int
    iterations: int
    rtt_us: float

    @property
    def one_way_us(self) -> float:
        return self.rtt_us / 2

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "one_way_us": self.one_way_us}


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Everything one ``run`` measured; ``to_dict`` is ``kvmove-bench transfer --json``."""

    config: BenchConfig
    rows: tuple[TransferRow, ...]
    round_trip: RoundTrip
    memcpy: dict[int, float]  # nbytes -> GB/s
    perftest_bw: tuple[perftest.PerftestResult, ...]
    perftest_lat: tuple[perftest.PerftestResult, ...]
    wall_seconds: float

    @property
    def verified(self) -> bool:
        return all(row.verified for row in self.rows)

    def memcpy_pct(self, row: TransferRow) -> float:
        return row.gbytes_per_s / self.memcpy[row.nbytes] * 100.0

    def perftest_for(self, row: TransferRow) -> perftest.PerftestResult:
        """The ``ucp_put_bw`` (write) or ``ucp_get`` (read) baseline at the row's op size."""
        test = _PERFTEST_TEST[row.op]
        return next(p for p in self.perftest_bw
                    if p.test == test and p.message_nbytes == row.op_nbytes)

    def perftest_pct(self, row: TransferRow) -> float | None:
        baseline = self.perftest_for(row)
        return row.gbytes_per_s / baseline.gbytes_per_s * 100.0 if baseline.available else None

    def links(self) -> list[dict[str, Any]]:
        """The first allocator rows' bytes over the article's links and as measured here."""
        rows = [r for r in self.rows if r.placement == self.config.placements[0]
                and r.block_size == self.config.block_sizes[0]]
        links = [{"name": link.name, "gbytes_per_s": link.gbytes_per_s,
                  "transfer_ms": transfer_ms(rows[0].nbytes, link), "measured": False}
                 for link in DEFAULT_LINKS]
        return links + [{"name": f"this machine, {r.op} ({r.placement})",
                         "gbytes_per_s": r.gbytes_per_s, "transfer_ms": r.total_seconds * 1e3,
                         "measured": True} for r in rows]

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        layout = self.config.layout(self.config.block_sizes[0])
        rows = [{**row.to_dict(), "memcpy_pct": self.memcpy_pct(row),
                 "perftest_pct": self.perftest_pct(row),
                 "perftest_test": _PERFTEST_TEST[row.op]} for row in self.rows]
        return {
            "config": config, "statistic": f"best of {self.config.iters} after 1 warm-up",
            "layout": asdict(layout), "kv_bytes": layout.bytes_for(self.config.num_tokens),
            "rows": rows, "verified": self.verified, "round_trip": self.round_trip.to_dict(),
            "baselines": {
                "memcpy": [{"nbytes": n, "gbytes_per_s": g} for n, g in self.memcpy.items()],
                "perftest_bw": [p.to_dict() for p in self.perftest_bw],
                "perftest_put_lat": [p.to_dict() for p in self.perftest_lat],
            },
            "links": self.links(), "wall_seconds": self.wall_seconds,
        }


# --- the data pattern -----------------------------------------------------------------------

def _words(cache: KVCache) -> np.ndarray:
    """The cache as writable uint64 words ``[L, N, words per block per layer]``."""
    lay = cache.layout
    raw = np.frombuffer(cache.region, dtype=np.uint8)
    return raw.view(np.uint64).reshape(lay.num_layers, cache.num_blocks, -1)


def _base(seed: int, num_words: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**64 - 1, size=num_words, dtype=np.uint64, endpoint=True)


def _keys(seed: int, layer: int, src_ids: np.ndarray) -> np.ndarray:
    """One 64-bit key per (layer, source block): splitmix64 of (seed, layer, id)."""
    x = src_ids.astype(np.uint64) + np.uint64(((seed & 0xFFFF) << 48) | ((layer + 1) << 32))
    x = x * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Side:
    """One process's cache and agent, and the pattern operations on its blocks."""

    def __init__(self, name: str, layout: KVLayout, num_blocks: int,
                 agent_kwargs: dict[str, Any]) -> None:
        if layout.bytes_per_block_per_layer % 8:
            raise ConfigError(f"bytes per block per layer must be a multiple of 8, got "
                              f"{layout.bytes_per_block_per_layer}")
        self.cache = KVCache(layout, num_blocks)
        self.words = _words(self.cache)
        try:
            self.agent = Agent(name, self.cache, **agent_kwargs)
        except KVMoveError as error:
            raise BenchError(f"cannot create agent {name!r} with {agent_kwargs}: "
                             f"{error}") from error
        self._held: list[int] = []

    def place(self, num_blocks: int, placement: str, seed: int) -> list[int]:
        """Owns ``num_blocks`` blocks placed as ``placement`` (releasing the previous ones)."""
        pool = self.cache.pool
        if self._held:
            pool.free(self._held)
        if placement == "allocator":
            self._held = pool.allocate(num_blocks)
        else:
            every = pool.allocate(self.cache.num_blocks)
            order = np.random.default_rng(seed).permutation(len(every))
            self._held = [every[i] for i in order[:num_blocks]]
            pool.free([every[i] for i in order[num_blocks:]])
        return list(self._held)

    def fill(self, ids: list[int], seed: int) -> None:
        base, ids_arr = _base(seed, self.words.shape[2]), np.asarray(ids)
        for layer in range(self.words.shape[0]):
            self.words[layer, ids_arr] = base ^ _keys(seed, layer, ids_arr)[:, None]

    def wipe(self, ids: list[int]) -> None:
        self.words[:, np.asarray(ids)] = _WIPE

    def mismatches(self, ids: list[int], src_ids: list[int], seed: int) -> int:
        """(layer, block) pairs of ``ids`` not holding the pattern of ``src_ids`` (same order)."""
        base, ids_arr, src_arr = _base(seed, self.words.shape[2]), np.asarray(ids), \
            np.asarray(src_ids)
        bad = 0
        for layer in range(self.words.shape[0]):
            expected = base ^ _keys(seed, layer, src_arr)[:, None]
            got = self.words[layer, ids_arr]
            if not np.array_equal(got, expected):
                bad += int(np.count_nonzero((got != expected).any(axis=1)))
        return bad

    def check_after_notification(self, tag: bytes, ids: list[int], src_ids: list[int],
                                 seed: int, timeout: float) -> int:
        """Waits for the notification ``tag``, then counts ``mismatches``."""
        peer, payload = self.agent.wait_notification(timeout)
        if bytes(payload) != tag:
            raise BenchError(f"expected notification {tag!r}, got {bytes(payload)!r} "
                             f"from {peer!r}")
        return self.mismatches(ids, src_ids, seed)

    def echo(self, count: int, local_id: int, remote_id: int, timeout: float) -> None:
        """Answers ``count`` pings: each notification is answered by a one-block write of
        layer 0 with a notification."""
        for _ in range(count):
            peer, _payload = self.agent.wait_notification(timeout)
            self.agent.write(peer, [local_id], [remote_id], layers=[0],
                             notify=b"pong").wait(timeout)

    def close(self) -> None:
        self.agent.close()


_PEER_COMMANDS = ("place", "fill", "wipe", "mismatches", "check_after_notification", "echo")


def _peer_main(conn: Any) -> None:
    """The peer process: ``("setup", args)`` builds a ``Side`` (replacing the last one) and
    answers its listen address; other commands call that ``Side``; ``None`` or EOF ends it.
    Every reply is ``("ok", value)`` or ``("err", message)``."""
    side: Side | None = None
    try:
        while conn.poll(_PEER_IDLE_SECONDS):
            message = conn.recv()
            if message is None:
                break
            command, args = message
            try:
                if command == "setup":
                    if side is not None:
                        side.close()
                    side = None
                    side = Side(*args)
                    conn.send(("ok", side.agent.listen()))
                elif command in _PEER_COMMANDS and side is not None:
                    conn.send(("ok", getattr(side, command)(*args)))
                else:
                    raise BenchError(f"unknown peer command {command!r} (or no setup yet)")
            except Exception as error:  # the parent reports it; the peer keeps serving
                conn.send(("err", f"{type(error).__name__}: {error}"))
    except (EOFError, OSError):
        pass
    finally:
        if side is not None:
            side.close()


class Peer:
    """Parent-side handle of the peer process; every reply has a deadline."""

    def __init__(self, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.timeout = timeout
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child,), name="kvmove-bench-peer",
                                   daemon=True)
        self.process.start()
        child.close()

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.reply(command)

    def send(self, command: str, *args: Any) -> None:
        try:
            self.conn.send((command, args))
        except OSError as error:
            raise BenchError(f"peer process gone before {command!r}: {error}") from None

    def reply(self, command: str) -> Any:
        deadline = time.monotonic() + self.timeout
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise BenchError(f"peer process died during {command!r} (exit code "
                                 f"{self.process.exitcode})")
            if time.monotonic() > deadline:
                raise BenchError(f"peer process did not answer {command!r} within "
                                 f"{self.timeout:g} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1)
            raise BenchError(f"peer process died during {command!r} (exit code "
                             f"{self.process.exitcode})") from None
        if status == "err":
            raise BenchError(f"peer process failed in {command!r}: {value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


# --- measuring ------------------------------------------------------------------------------

def _timed(transfer_call: Callable[[], Any], timeout: float) -> tuple[Any, float]:
    start = time.perf_counter()
    transfer = transfer_call()
    transfer.wait(timeout)
    return transfer.stats, time.perf_counter() - start


def _row(op: str, placement: str, layout: KVLayout, ids: list[int],
         results: list[tuple[Any, float, int]]) -> TransferRow:
    """The row of the best timed iteration; ``results[0]`` is the warm-up."""
    timed = results[1:]
    stats, seconds, _ = min(timed, key=lambda r: r[1])
    return TransferRow(op, placement, layout.block_size, stats.nbytes, len(ids), stats.num_ops,
                       stats.post_seconds, seconds, stats.complete_seconds,
                       tuple(r[1] for r in timed), results[0][1], sum(r[2] for r in results))


def _write(near: Side, peer: Peer, local_ids: list[int], remote_ids: list[int], seed: int,
           config: BenchConfig) -> list[tuple[Any, float, int]]:
    near.fill(local_ids, seed)
    results = []
    for i in range(config.iters + 1):
        peer.call("wipe", remote_ids)
        tag = f"bench-write-{seed}-{i}".encode()
        stats, seconds = _timed(
            lambda: near.agent.write(_FAR, local_ids, remote_ids, notify=tag), config.timeout)
        bad = peer.call("check_after_notification", tag, remote_ids, local_ids, seed,
                        config.timeout)
        results.append((stats, seconds, bad))
    return results


def _read(near: Side, peer: Peer, local_ids: list[int], remote_ids: list[int], seed: int,
          config: BenchConfig) -> list[tuple[Any, float, int]]:
    peer.call("fill", remote_ids, seed)
    results = []
    for _ in range(config.iters + 1):
        near.wipe(local_ids)
        stats, seconds = _timed(lambda: near.agent.read(_FAR, local_ids, remote_ids),
                                config.timeout)
        results.append((stats, seconds, near.mismatches(local_ids, remote_ids, seed)))
    return results


def _round_trip(near: Side, peer: Peer, local_id: int, remote_id: int,
                config: BenchConfig) -> RoundTrip:
    """Median of ``round_trips`` ping-pongs (after a warm-up): one block of layer 0 each way,
    each announced by a notification, as a layer-wise stream's smallest hand-off."""
    near.agent.notifications()
    count = _ROUND_TRIP_WARMUP + config.round_trips
    peer.send("echo", count, remote_id, local_id, config.timeout)
    rtts = []
    for _ in range(count):
        start = time.perf_counter()
        transfer = near.agent.write(_FAR, [local_id], [remote_id], layers=[0], notify=b"ping")
        near.agent.wait_notification(config.timeout)
        rtts.append(time.perf_counter() - start)
        transfer.wait(config.timeout)
    peer.reply("echo")
    nbytes = near.cache.layout.bytes_per_block_per_layer
    return RoundTrip(nbytes, config.round_trips,
                     float(np.median(rtts[_ROUND_TRIP_WARMUP:])) * 1e6)


def _measure_block_size(peer: Peer, config: BenchConfig, block_size: int, progress: Progress,
                        with_round_trip: bool) -> tuple[list[TransferRow], RoundTrip | None]:
    layout = config.layout(block_size)
    num_blocks = layout.blocks_for(config.num_tokens)
    cache_blocks = num_blocks * config.spare_factor
    address = peer.call("setup", _FAR, layout, cache_blocks, config.agent_kwargs)
    near = Side(_NEAR, layout, cache_blocks, config.agent_kwargs)
    try:
        near.agent.connect(*address, timeout=config.timeout)
        rows, round_trip = [], None
        for index, placement in enumerate(config.placements):
            seed = config.seed * 1000 + block_size * 10 + index
            local_ids = near.place(num_blocks, placement, seed)
            remote_ids = peer.call("place", num_blocks, placement, seed + 1)
            for op, measure, op_seed in (("write", _write, seed), ("read", _read, seed + 2)):
                results = measure(near, peer, local_ids, remote_ids, op_seed, config)
                rows.append(_row(op, placement, layout, local_ids, results))
                progress(f"{op} {placement} block {block_size}")
            if with_round_trip and round_trip is None:
                round_trip = _round_trip(near, peer, local_ids[0], remote_ids[0], config)
                progress("round trip")
        return rows, round_trip
    finally:
        near.close()


def memcpy_gbytes_per_s(nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` ``np.copyto`` between two preallocated, touched arrays."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst.fill(1)  # zeros() maps lazily: touch the pages so the copy does not fault them in
    best = min(_copy_seconds(dst, src) for _ in range(repeats))
    return nbytes / best / 1e9


def _copy_seconds(dst: np.ndarray, src: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


def count_steps(config: BenchConfig) -> int:
    """How many times ``run`` calls ``progress``."""
    num_rows = 2 * len(config.block_sizes) * len(config.placements)
    # rows, ucx_perftest bandwidth per row and extra size, round trip, 2 latencies, memcpy
    return 2 * num_rows + len(config.perftest_sizes) + 1 + 2 + len(config.block_sizes)


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Measures ``config``'s transfers, then its baselines; ``progress(label)`` after each step.

    Raises:
        BenchError: the peer process failed, died or timed out.
        KVMoveError: a transfer failed (``TransferError``, ``PeerError``, ``TimeoutError``).
    """
    progress = progress or (lambda label: None)
    start = time.perf_counter()
    rows, round_trip = _measure_transfers(config, progress)
    perftest_bw = _perftest_bandwidths(config, rows, progress)
    lat_kwargs = {"transports": config.transports, "timeout": config.timeout,
                  "error_handling": config.error_mode == "peer"}
    perftest_lat = []
    for size in (8, round_trip.nbytes):
        perftest_lat.append(perftest.put_latency(size, iterations=1000, **lat_kwargs))
        progress(f"ucx_perftest put latency {size} B")
    memcpy: dict[int, float] = {}
    for block_size in config.block_sizes:
        nbytes = next(row.nbytes for row in rows if row.block_size == block_size)
        if nbytes not in memcpy:
            memcpy[nbytes] = memcpy_gbytes_per_s(nbytes)
        progress(f"memcpy {nbytes} B")
    return BenchReport(config, tuple(rows), round_trip, memcpy, tuple(perftest_bw),
                       tuple(perftest_lat), time.perf_counter() - start)


def _measure_transfers(config: BenchConfig,
                       progress: Progress) -> tuple[list[TransferRow], RoundTrip]:
    peer = Peer(config.timeout)
    try:
        rows: list[TransferRow] = []
        round_trip = None
        for block_size in config.block_sizes:
            more, trip = _measure_block_size(peer, config, block_size, progress,
                                             with_round_trip=round_trip is None)
            rows += more
            round_trip = round_trip or trip
        return rows, round_trip
    finally:
        peer.stop()


def _perftest_bandwidths(config: BenchConfig, rows: list[TransferRow],
                         progress: Progress) -> list[perftest.PerftestResult]:
    """Per row, the best of ``iters`` runs of ``ucp_put_bw`` (write) or ``ucp_get`` (read) at
    the row's mean op size, moving the row's bytes each; then ``ucp_put_bw`` at
    ``config.perftest_sizes``.

    The same message size as kvmove posts isolates kvmove's own overhead (validation,
    coalescing, flush, notification). The whole transfer as one message would be a put kvmove
    cannot post: a layer's blocks are not contiguous with the next layer's.
    """
    results: dict[tuple[str, int], perftest.PerftestResult] = {}
    wanted = [(_PERFTEST_TEST[row.op], row.op_nbytes, row.nbytes) for row in rows]
    wanted += [("ucp_put_bw", size, rows[0].nbytes) for size in config.perftest_sizes]
    for test, size, total in wanted:
        if (test, size) not in results:
            results[test, size] = _best_bandwidth(config, test, size, total)
        progress(f"ucx_perftest {test} {size} B")
    return sorted(results.values(), key=lambda p: (p.test, p.message_nbytes))


def _best_bandwidth(config: BenchConfig, test: str, size: int,
                    total: int) -> perftest.PerftestResult:
    """Best of ``iters`` runs, as for kvmove's rows; the last failure if none ran."""
    runs = [perftest.bandwidth(test, size, total_nbytes=total, transports=config.transports,
                               error_handling=config.error_mode == "peer",
                               timeout=config.timeout)
            for _ in range(config.iters)]
    available = [r for r in runs if r.available]
    return max(available, key=lambda r: r.gbytes_per_s) if available else runs[-1]
