"""``kvmove-bench transfer``: real transfers between two processes, and the baselines they are
compared against, all from the same run; the subcommand prints ``transfer_report``'s text of
them, or its JSON.

The far side is a spawned process with its own ``KVCache`` and ``Agent``, driven over a
``multiprocessing`` Pipe: every reply has a deadline, and a dead peer is noticed within 50 ms.
With ``--connect`` it is a ``--listen`` side on another machine instead (``remote``), driven
the same way over an authenticated socket; it then also runs ucx_perftest's server.
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

With ``--wrap FORMAT`` each block size runs twice, native caches first: then two caches of
that engine's own tensors (``engine_caches``: numpy arrays in the engine's shapes, wrapped as
docs/engines.md says) move the same KV through the same peer and pattern code, one pair of
caches alive at a time; each wrapped row is compared with its native row of this run. Each
near ``Side`` also times its registration (``transfer_report.REGISTRATION_TIMED``).

Iteration 0 is an untimed warm-up (UCX wires endpoints up and unpacks keys on first use);
a row reports the *best* of the ``iters`` timed iterations, since on a shared machine noise
only ever slows a run down. Every iteration, the warm-up included, is verified.

Baselines, measured after the transfers (the peer gone, so nothing competes): memcpy of each
row's bytes (``np.copyto``, one thread); the machine's copy limit for those bytes, kvmove's own
copy kernel on as many threads as the agents copy with, between two buffers of one process
(``_C.copy_limit_gbytes_per_s``: a same-host row's "% of limit" reads as its overhead, and
stays under ~100%; not measured between two machines); and ``ucx_perftest`` on the same
transports and error mode,
best of ``iters`` runs like the rows: ``ucp_put_bw`` for WRITE rows and ``ucp_get`` for READ
rows, at the row's mean bytes per posted op; ``ucp_put_lat`` at 8 B and at the round trip's
size for the one-block write + notification round trip.

With ``--against nixl`` (``against``), ``--against mooncake`` (``against_mooncake``) or both
(``--against nixl --against mooncake``) the native rows' workload and the round trip run
through each library as well, one after the other, after kvmove's rows and before the
baselines, and each row shows kvmove / it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmove import _C
from kvmove.auth import key_from_file
from kvmove.bench import against, against_mooncake, perftest
from kvmove.bench.address import parse_address, route_address
from kvmove.bench.against_report import AGAINST
from kvmove.bench.engine_caches import WRAP_FORMATS
from kvmove.bench.harness import Channel
from kvmove.bench.mooncake_side import MOONCAKE_INSTALL
from kvmove.bench.nixl_side import NIXL_INSTALL
from kvmove.bench.options import add_agent_args, add_output_args, add_prompt_args, check_plot
from kvmove.bench.peer import FAR, Peer, Side, connect_pair, ping, stop_echo
from kvmove.bench.progress import Progress, bar
from kvmove.bench.remote import RemotePeer, RemotePerftest, listen
from kvmove.bench.transfer_report import (
    MEMORIES,
    NATIVE,
    PERFTEST_TEST,
    ROUND_TRIP_WARMUP,
    SWEEP_BLOCK_SIZES,
    BenchConfig,
    BenchReport,
    Registration,
    RoundTrip,
    TransferRow,
)
from kvmove.bench.transfer_text import format_transfer, plot_transfer
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec
from kvmove.runtime import cuda_available, cuda_status, ucx_info

__all__ = ["add_parser", "count_steps", "memcpy_gbytes_per_s", "run", "run_command"]

# (transport, device) pairs, as Agent.peer_transports gives them.
Transports = tuple[tuple[str, str], ...]
# How the near agent reaches the far one (Agent.peer_path: "mapped" or "ucx"), and the UCX
# transports between them (which carry the notifications on the mapped path too).
Route = tuple[str, Transports]

# Each library of --against (against_report.AGAINST) and the module that runs it: probe,
# count_steps and run.
_DRIVERS = {"nixl": against, "mooncake": against_mooncake}


# --- measuring ------------------------------------------------------------------------------

def _timed(post: Callable[..., Any], *args: Any, timeout: float, **kwargs: Any
           ) -> tuple[Any, float]:
    """Wall seconds from ``post(*args, **kwargs)`` (``write`` or ``read``) until its transfer's
    ``wait`` returns, and the transfer's stats."""
    start = time.perf_counter()
    transfer = post(*args, **kwargs)
    transfer.wait(timeout)
    return transfer.stats, time.perf_counter() - start


def _row(op: str, placement: str, layout: KVSpec, ids: list[int],
         results: list[tuple[Any, float, int]], cache: str) -> TransferRow:
    """The row of the best timed iteration; ``results[0]`` is the warm-up."""
    timed = results[1:]
    stats, seconds, _ = min(timed, key=lambda r: r[1])
    return TransferRow(op, placement, layout.block_size, stats.nbytes, len(ids), stats.num_ops,
                       stats.post_seconds, seconds, stats.complete_seconds,
                       tuple(r[1] for r in timed), results[0][1], sum(r[2] for r in results),
                       cache)


def _write(near: Side, peer: Channel, local_ids: list[int], remote_ids: list[int], seed: int,
           config: BenchConfig) -> list[tuple[Any, float, int]]:
    near.fill(local_ids, seed)
    results = []
    for i in range(config.iters + 1):
        peer.call("wipe", remote_ids)
        tag = f"bench-write-{seed}-{i}".encode()
        stats, seconds = _timed(near.agent.write, FAR, local_ids, remote_ids, notify=tag,
                                timeout=config.timeout)
        bad = peer.call("check_after_notification", tag, remote_ids, local_ids, seed,
                        config.timeout)
        results.append((stats, seconds, bad))
    return results


def _read(near: Side, peer: Channel, local_ids: list[int], remote_ids: list[int], seed: int,
          config: BenchConfig) -> list[tuple[Any, float, int]]:
    peer.call("fill", remote_ids, seed)
    results = []
    for _ in range(config.iters + 1):
        near.wipe(local_ids)
        stats, seconds = _timed(near.agent.read, FAR, local_ids, remote_ids,
                                timeout=config.timeout)
        results.append((stats, seconds, near.mismatches(local_ids, remote_ids, seed)))
    return results


def _round_trip(near: Side, peer: Channel, local_id: int, remote_id: int,
                config: BenchConfig) -> RoundTrip:
    """Median of ``round_trips`` pings (after a warm-up), the smallest hand-off a layer-wise
    stream makes."""
    near.agent.notifications()
    peer.send("echo", remote_id, local_id, config.timeout)
    rtts = []
    for _ in range(ROUND_TRIP_WARMUP + config.round_trips):
        start = time.perf_counter()
        ping(near.agent, FAR, local_id, remote_id, config.timeout)
        rtts.append(time.perf_counter() - start)
    stop_echo(near.agent, FAR, local_id, remote_id, config.timeout)
    peer.reply("echo")
    nbytes = near.cache.layout.bytes_per_block_per_layer
    return RoundTrip(nbytes, config.round_trips,
                     float(np.median(rtts[ROUND_TRIP_WARMUP:])) * 1e6)


def _measure_cache(peer: Channel, config: BenchConfig, block_size: int, cache: str,
                   progress: Progress, with_round_trip: bool
                   ) -> tuple[list[TransferRow], RoundTrip | None, Registration, Route]:
    """The rows of one block size between two caches of kind ``cache`` (``NATIVE`` or a
    wrapped format), how long the near side's registration took, and the transports UCX
    chose between the two agents, with the path the bytes took."""
    layout = config.layout(block_size)
    num_blocks = layout.blocks_for(config.num_tokens)
    cache_blocks = num_blocks * config.spare_factor
    near = connect_pair(peer, layout, cache_blocks, config.agent_kwargs, config.timeout,
                        wrap=None if cache == NATIVE else cache, device=config.device)
    try:
        route = (near.agent.peer_path(FAR), tuple(near.agent.peer_transports(FAR)))
        rows, round_trip = [], None
        for index, placement in enumerate(config.placements):
            seed = config.seed * 1000 + block_size * 10 + index
            local_ids = near.place(num_blocks, placement, seed)
            remote_ids = peer.call("place", num_blocks, placement, seed + 1)
            for op, measure, op_seed in (("write", _write, seed), ("read", _read, seed + 2)):
                results = measure(near, peer, local_ids, remote_ids, op_seed, config)
                rows.append(_row(op, placement, layout, local_ids, results, cache))
                progress(f"{op} {placement} {cache} block {block_size}")
            if with_round_trip and round_trip is None:
                round_trip = _round_trip(near, peer, local_ids[0], remote_ids[0], config)
                progress("round trip")
        return rows, round_trip, near.registration, route
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
    num_rows = 2 * len(config.block_sizes) * len(config.placements) * len(config.caches)
    # rows, ucx_perftest bandwidth per row and extra size, round trip, 2 latencies, memcpy
    steps = 2 * num_rows + len(config.perftest_sizes) + 1 + 2 + len(config.block_sizes)
    return steps + sum(_DRIVERS[name].count_steps(config) for name in config.against)


def run(config: BenchConfig, progress: Progress | None = None) -> BenchReport:
    """Measures ``config``'s transfers, then its baselines; ``progress(label)`` after each step.

    Raises:
        BenchError: the peer process failed, died or timed out.
        KVMoveError: a transfer failed (``TransferError``, ``PeerError``, ``TimeoutError``).
    """
    progress = progress or (lambda label: None)
    if config.memory == "cuda" and not cuda_available():
        raise ConfigError(f"memory 'cuda' needs a usable CUDA device here: "
                          f"{cuda_status().reason}")
    start = time.perf_counter()
    remote = None
    if config.connect is not None:
        host, port = parse_address(config.connect, "connect")
        if config.host is None:
            config = dataclasses.replace(config, host=route_address(host, port))
        remote = RemotePeer(host, port, config.timeout)
    try:
        rows, round_trip, registrations, (path, transports) = _measure_transfers(
            config, remote or Peer(config.timeout), progress)
        nixl = against.run(config, progress) if "nixl" in config.against else None
        mooncake = against_mooncake.run(config, progress) if "mooncake" in config.against \
            else None
        # On one host the peer is gone by now, so nothing competes with the baselines; with
        # another machine, its side runs ucx_perftest's server over the same link.
        server = None if remote is None else RemotePerftest(remote, config.transports,
                                                            config.error_mode == "peer")
        perftest_bw = _perftest_bandwidths(config, rows, progress, server)
        perftest_lat = []
        for size in (8, round_trip.nbytes):
            perftest_lat.append(_best_latency(config, size, server))
            progress(f"ucx_perftest put latency {size} B")
    finally:
        if remote is not None:
            remote.stop()
    memcpy: dict[int, float] = {}
    limit: dict[int, float] = {}
    threads = _C.default_copy_threads()  # what the bench's agents copy with
    for block_size in config.block_sizes:
        nbytes = next(row.nbytes for row in rows if row.block_size == block_size)
        if nbytes not in memcpy:
            memcpy[nbytes] = memcpy_gbytes_per_s(nbytes)
            if remote is None:  # a limit of this machine alone: nothing to say between two
                limit[nbytes] = _C.copy_limit_gbytes_per_s(nbytes, threads)
        progress(f"memcpy {nbytes} B")
    return BenchReport(config, tuple(rows), round_trip, memcpy, tuple(perftest_bw),
                       tuple(perftest_lat), time.perf_counter() - start, tuple(registrations),
                       nixl, transports, path, ucx_info(), limit, threads, mooncake)


def _measure_transfers(config: BenchConfig, peer: Channel, progress: Progress
                       ) -> tuple[list[TransferRow], RoundTrip, list[Registration], Route]:
    """Per block size, the native caches' rows, then the wrapped ones' (``config.caches``):
    each pair of caches is made, measured and closed before the next, so two never compete
    for memory. The route is the first pair's. A local ``Peer`` is stopped at the end; a
    ``RemotePeer`` stays for the baselines."""
    try:
        rows: list[TransferRow] = []
        registrations: list[Registration] = []
        round_trip, route = None, None
        for block_size in config.block_sizes:
            for cache in config.caches:
                more, trip, registration, used = _measure_cache(
                    peer, config, block_size, cache, progress, with_round_trip=round_trip is None)
                rows += more
                registrations.append(registration)
                round_trip = round_trip or trip
                route = route or used
        # BenchConfig holds at least one block size, and caches() the native cache at least
        assert round_trip is not None and route is not None
        return rows, round_trip, registrations, route
    finally:
        if isinstance(peer, Peer):
            peer.stop()


def _perftest_bandwidths(config: BenchConfig, rows: list[TransferRow], progress: Progress,
                         server: perftest.Server | None) -> list[perftest.PerftestResult]:
    """Per row, the best of ``iters`` runs of ``ucp_put_bw`` (write) or ``ucp_get`` (read) at
    the row's mean op size, moving the row's bytes each; then ``ucp_put_bw`` at
    ``config.perftest_sizes``.

    The same message size as kvmove posts isolates kvmove's own overhead (validation,
    coalescing, flush, notification). The whole transfer as one message would be a put kvmove
    cannot post: a layer's blocks are not contiguous with the next layer's.
    """
    results: dict[tuple[str, int], perftest.PerftestResult] = {}
    wanted = [(PERFTEST_TEST[row.op], row.op_nbytes, row.nbytes) for row in rows]
    wanted += [("ucp_put_bw", size, rows[0].nbytes) for size in config.perftest_sizes]
    for test, size, total in wanted:
        if (test, size) not in results:
            results[test, size] = _best_bandwidth(config, test, size, total, server)
        progress(f"ucx_perftest {test} {size} B")
    return sorted(results.values(), key=lambda p: (p.test, p.message_nbytes))


def _best_latency(config: BenchConfig, size: int,
                  server: perftest.Server | None) -> perftest.PerftestResult:
    """Lowest median of ``iters`` ``ucp_put_lat`` runs: over tcp a run sometimes settles at
    ~4 ms per ping-pong (a timer tick, not the transport), which one run cannot tell apart."""
    runs = [perftest.put_latency(size, iterations=300, transports=config.transports,
                                 error_handling=config.error_mode == "peer",
                                 timeout=config.timeout, server=server)
            for _ in range(config.iters)]
    available = [r for r in runs if r.available]
    return min(available, key=lambda r: _measured(r.latency_us)) if available else runs[-1]


def _best_bandwidth(config: BenchConfig, test: str, size: int, total: int,
                    server: perftest.Server | None) -> perftest.PerftestResult:
    """Best of ``iters`` runs, as for kvmove's rows; the last failure if none ran."""
    runs = [perftest.bandwidth(test, size, total_nbytes=total, transports=config.transports,
                               error_handling=config.error_mode == "peer",
                               timeout=config.timeout, server=server)
            for _ in range(config.iters)]
    available = [r for r in runs if r.available]
    return max(available, key=lambda r: _measured(r.gbytes_per_s)) if available else runs[-1]


def _measured(value: float | None) -> float:
    """A number of an available ucx_perftest run, which always has it."""
    assert value is not None
    return value


# --- the subcommand -------------------------------------------------------------------------

# --sweep also runs ucx_perftest at these message sizes, so the plot has a baseline curve.
SWEEP_MESSAGE_SIZES = (4096, 65536, 1 << 20, 16 << 20)


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "transfer", help="move one prompt's KV cache between two processes and measure it",
        description="Moves one prompt's KV cache between two local processes with kvmove "
        "(WRITE and READ), verifies every byte, and compares with memcpy and ucx_perftest "
        "measured in the same run.")
    add_prompt_args(sub)
    add_agent_args(sub, "kvmove and ucx_perftest")
    sub.add_argument("--scatter", action="store_true",
                     help="add rows with blocks scattered at random over both caches")
    sweep_sizes = "/".join(map(str, SWEEP_BLOCK_SIZES))
    sub.add_argument("--sweep", action="store_true",
                     help=f"rows for block sizes {sweep_sizes}, and ucx_perftest at more "
                     "message sizes")
    sub.add_argument("--wrap", choices=list(WRAP_FORMATS), default=None, metavar="FORMAT",
                     help="also move the same KV between two caches of this engine's own "
                     f"tensors, wrapped with KVCache.wrap, beside the native rows: one of "
                     f"{', '.join(WRAP_FORMATS)} (docs/engines.md)")
    sub.add_argument("--against", choices=list(AGAINST), action="append", default=[],
                     help="also run the same workload (native rows, round trip) through this "
                     "library in the same run and print kvmove / it per row (give it twice "
                     f"for both); nixl needs '{NIXL_INSTALL}', mooncake '{MOONCAKE_INSTALL}'")
    two = sub.add_argument_group(
        "between two machines", "one side --listen, the other --connect with the options of the "
        "run; both need the same deployment key (--key-file, or KVMOVE_KEY_FILE / KVMOVE_KEY)")
    where = two.add_mutually_exclusive_group()
    where.add_argument("--listen", metavar="[HOST:]PORT", default=None,
                       help="host the far side of one --connect run from another machine, "
                       "then exit (HOST: the address to serve on, default 0.0.0.0)")
    where.add_argument("--connect", metavar="HOST:PORT", default=None,
                       help="run with the far side on the machine listening there (its "
                       "ucx_perftest server gives the same-link baseline)")
    two.add_argument("--host", default=None, metavar="ADDR",
                     help="this side's agents' address (default: with --connect, this "
                     "machine's address on the route to HOST)")
    sub.add_argument("--memory", choices=list(MEMORIES), default="host",
                     help="where both caches live: host memory, or 'cuda' (device memory on "
                     "both sides; needs a CUDA build and device, else exits 2 saying why)")
    two.add_argument("--key-file", default=None, metavar="PATH",
                     help="the deployment key (default: KVMOVE_KEY_FILE, KVMOVE_KEY, else this "
                     "host's key, which another machine does not share)")
    add_output_args(sub, "timed iterations per row, after one warm-up; the best is shown",
                    "also draw bandwidth vs bytes per operation (needs matplotlib)")
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    if args.key_file is not None:
        key_from_file(args.key_file)  # readable and long enough, or ConfigError now
        os.environ["KVMOVE_KEY_FILE"] = os.path.abspath(args.key_file)  # this side's agents
        os.environ.pop("KVMOVE_KEY", None)  # which would win over the file
    if args.listen is not None:
        return listen(args.listen, args.timeout)
    config = _transfer_config(args)
    if args.plot:
        check_plot(args.plot)
    for name in config.against:  # each library missing: exit 2 naming its install, at once
        _DRIVERS[name].probe(config)
    with bar(args, count_steps(config)) as progress:
        report = run(config, progress)
    if args.plot:
        plot_transfer(report, args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_transfer(report))
    if not report.verified:
        nixl_rows = report.nixl.rows if report.nixl else ()
        mooncake_rows = report.mooncake.rows if report.mooncake else ()
        bad = [f"{who}{r.op} {r.placement} block {r.block_size}: {r.mismatched_blocks}"
               for who, rows in (("", report.rows), ("NIXL ", nixl_rows),
                                 ("Mooncake ", mooncake_rows))
               for r in rows if not r.verified]
        print(f"kvmove-bench transfer: error: bytes arrived wrong ((layer, block) pairs per "
              f"row, all iterations): {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _transfer_config(args: argparse.Namespace) -> BenchConfig:
    sizes = (args.block_size,)
    if args.sweep:
        sizes += tuple(s for s in SWEEP_BLOCK_SIZES if s != args.block_size)
    return BenchConfig(
        model=args.model, num_tokens=args.tokens, block_sizes=sizes,
        placements=("allocator", "scatter") if args.scatter else ("allocator",),
        transports=args.transports, error_mode=args.error_mode, same_host=args.same_host,
        iters=args.iters, perftest_sizes=SWEEP_MESSAGE_SIZES if args.sweep else (),
        timeout=args.timeout, wrap=args.wrap, against=tuple(dict.fromkeys(args.against)),
        connect=args.connect, host=args.host, memory=args.memory)


