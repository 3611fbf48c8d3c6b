"""``kvmove-bench scale``: how an agent's cost grows with concurrent leases and with peers.

Two row sets, both in this process over real agents (the same-host mapped path by default;
``--transports tcp --same-host ucx`` for UCX's tcp), every byte verified:

* **leases**: one sender streams ``N`` one-block requests (every layer) into ``N`` leases a
  receiver opened at once (``Agent.expect``), for each ``N`` of ``--leases`` (1 ... 1,000):
  leases per second, GB/s, and the time per lease (the whole batch's time over ``N``), the
  median of ``--iters`` batches.
* **peers**: ``--peers`` sender agents (1 ... 32) connect to one receiver, one after the other:
  the time each connect took (metadata exchange, UCX endpoints, the mapping of its memory),
  the private resident memory a sender agent took (its cache is not touched yet) and what
  its connect added at both ends, private and shared (UCX's shared-memory segments; the
  mapping of the receiver's memory, counted once per mapping although no page is new), all
  before any byte moves; then at each count
  every sender streams ``--blocks-per-peer`` blocks into its own lease at once: aggregate
  GB/s.

The layout is small on purpose (4 layers x 8 KV heads x 128, float16, 16 tokens a block: a
block of one layer is 64 KiB, a lease 256 KiB): the rows measure what a lease and a peer
cost, not bandwidth, which ``kvmove-bench transfer`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvmove.agent import Agent
from kvmove.bench.options import add_agent_args, check_plot
from kvmove.bench.progress import bar
from kvmove.bench.report import BenchError
from kvmove.bench.scale_report import LeaseRow, PeerRow, ScaleReport, format_scale, plot_scale
from kvmove.errors import ConfigError
from kvmove.kv_cache import KVCache
from kvmove.kv_spec import KVSpec

__all__ = ["add_parser", "measure_leases", "measure_peers", "run_command"]

LAYOUT = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "scale", help="what concurrent leases and peers cost an agent",
        description="Streams 1 ... 1,000 one-block requests into as many concurrent leases, "
        "and connects 1 ... 32 peers to one agent: leases per second and the time per lease; "
        "connect time, memory per peer and aggregate GB/s with every peer streaming. Real "
        "agents in this process, every byte verified.")
    sub.add_argument("--leases", type=_counts, default=(1, 10, 100, 1000), metavar="N,N,...",
                     help="concurrent lease counts (default 1,10,100,1000)")
    sub.add_argument("--peers", type=_counts, default=(1, 2, 4, 8, 16, 32), metavar="N,N,...",
                     help="peer counts, rising (default 1,2,4,8,16,32)")
    sub.add_argument("--blocks-per-peer", type=int, default=16,
                     help="blocks each peer streams at each peer count (default 16)")
    sub.add_argument("--iters", type=int, default=3,
                     help="batches per lease count; the median is shown (default 3)")
    sub.add_argument("--timeout", type=float, default=60.0,
                     help="deadline of every wait in seconds (default 60)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.add_argument("--plot", metavar="PNG", default=None,
                     help="also plot time per lease and connect time / GB/s per peer count "
                     "to this PNG (needs matplotlib: kvmove[bench])")
    add_agent_args(sub, "every agent")
    sub.set_defaults(run=run_command)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,10,100, got {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 100_000:
        raise argparse.ArgumentTypeError(f"each count must be in [1, 100000], got {text!r}")
    return counts


def run_command(args: argparse.Namespace) -> int:
    if args.plot:
        check_plot(args.plot)
    for flag, value in (("--iters", args.iters), ("--blocks-per-peer", args.blocks_per_peer)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout}")
    if list(args.peers) != sorted(set(args.peers)):
        raise ConfigError(f"--peers must rise, got {','.join(map(str, args.peers))}")
    kwargs = {"transports": args.transports, "error_mode": args.error_mode,
              "same_host": args.same_host, "checksums": True}
    steps = len(args.leases) * args.iters + len(args.peers)
    with bar(args, steps) as progress:
        leases = measure_leases(args.leases, args.iters, kwargs, args.timeout, progress)
        peers = measure_peers(args.peers, args.blocks_per_peer, kwargs, args.timeout, progress)
    report = ScaleReport(LAYOUT.bytes_per_block, args.transports, args.same_host, leases, peers)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_scale(report))
    if args.plot:
        plot_scale(report, args.plot)
    return 0


# --- concurrent leases ------------------------------------------------------------------------


def measure_leases(counts: Sequence[int], iters: int, kwargs: dict, timeout: float,
                   progress: Callable[[str], None] = lambda label: None) -> list[LeaseRow]:
    """One row per count: the median of ``iters`` batches of that many concurrent leases."""
    size = max(counts)
    receiver = Agent("scale-receiver", KVCache(LAYOUT, size), **kwargs)
    sender = Agent("scale-sender", KVCache(LAYOUT, size), **kwargs)
    try:
        _fill(sender.cache, seed=1)
        host, port = receiver.listen()
        sender.connect(host, port, timeout=timeout)
        _lease_batch(receiver, sender, min(10, size), 0, timeout)  # warm-up: not shown
        rows, batch = [], 0
        for count in counts:
            times = []
            for _ in range(iters):
                batch += 1
                receiver.cache.numpy()[...] = 0
                times.append(_lease_batch(receiver, sender, count, batch, timeout))
                _verify(receiver.cache, sender.cache, range(count))
                progress(f"{count} leases")
            rows.append(LeaseRow(count, statistics.median(times)))
        return rows
    finally:
        sender.close()
        receiver.close()


def _lease_batch(receiver: Agent, sender: Agent, count: int, batch: int,
                 timeout: float) -> float:
    """Seconds from the first lease to the last load complete: ``count`` requests of block
    ``i`` (every layer) each into block ``i`` of its own lease."""
    return _stream_all(receiver, [(sender, [i], [i], f"b{batch}-r{i}") for i in range(count)],
                       timeout)


def _stream_all(receiver: Agent, jobs: list[tuple[Agent, list[int], list[int], str]],
                timeout: float) -> float:
    """Each job ``(sender, src_ids, dst_ids, request_id)`` leased at once and streamed (every
    layer); seconds from the first lease to the last load complete."""
    start = time.perf_counter()
    loads = [receiver.expect(sender.name, request, dst, timeout=timeout).start_load()
             for sender, _, dst, request in jobs]
    streams = [sender.stream_to(receiver.name, src, dst, request, epoch=load.epoch)
               for (sender, src, dst, request), load in zip(jobs, loads)]
    for stream in streams:
        for layer in range(LAYOUT.num_layers):
            stream.save_layer(layer)
        stream.finish()
    for load in loads:
        load.wait_all(timeout)
    seconds = time.perf_counter() - start
    for stream in streams:
        stream.wait_for_save(timeout)
    return seconds


# --- peers ----------------------------------------------------------------------------------


def measure_peers(counts: Sequence[int], blocks: int, kwargs: dict, timeout: float,
                  progress: Callable[[str], None] = lambda label: None) -> list[PeerRow]:
    """Connects senders one by one up to the most, then at each count streams from that many
    at once."""
    if list(counts) != sorted(set(counts)):
        raise ConfigError(f"peer counts must rise, got {','.join(map(str, counts))}")
    most = counts[-1]
    receiver = Agent("scale-hub", KVCache(LAYOUT, most * blocks), **kwargs)
    senders: list[Agent] = []
    try:
        host, port = receiver.listen()
        # First every connect, before any byte moves: a sender's mapping of the receiver's
        # memory counts in this process's resident set once it copies through it.
        connects: list[float] = []
        agent_rss: list[int] = []       # a sender agent's private memory
        connection_rss: list[int] = []  # what its connect added, private (both ends)
        connection_shared: list[int] = []  # and shared (UCX's shm, mapped peer memory)
        while len(senders) < most:
            before = _rss()
            sender = Agent(f"scale-peer-{len(senders)}", KVCache(LAYOUT, blocks), **kwargs)
            created = _rss()
            agent_rss.append(created["RssAnon"] - before["RssAnon"])
            start = time.perf_counter()
            sender.connect(host, port, timeout=timeout)
            connects.append(time.perf_counter() - start)
            connected = _rss()
            connection_rss.append(connected["RssAnon"] - created["RssAnon"])
            connection_shared.append(connected["RssShmem"] - created["RssShmem"])
            _fill(sender.cache, seed=len(senders) + 2)
            senders.append(sender)
        rows = []
        for count in counts:
            seconds = _all_stream(receiver, senders[:count], blocks, count, timeout)
            rows.append(PeerRow(count, statistics.median(connects[:count]),
                                max(connects[:count]), sum(agent_rss[:count]) // count,
                                sum(connection_rss[:count]) // count,
                                sum(connection_shared[:count]) // count,
                                count * blocks * LAYOUT.bytes_per_block, seconds))
            progress(f"{count} peers")
        return rows
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


def _all_stream(receiver: Agent, senders: list[Agent], blocks: int, round_: int,
                timeout: float) -> float:
    """Every sender streams its ``blocks`` blocks into its own lease at once; seconds from the
    first lease to the last load complete. Verified."""
    receiver.cache.numpy()[...] = 0
    seconds = _stream_all(receiver, [(sender, list(range(blocks)),
                                      list(range(p * blocks, (p + 1) * blocks)), f"p{round_}")
                                     for p, sender in enumerate(senders)], timeout)
    for p, sender in enumerate(senders):
        _verify(receiver.cache, sender.cache, range(blocks), offset=p * blocks)
    return seconds


# --- helpers --------------------------------------------------------------------------------


def _fill(cache: KVCache, seed: int) -> None:
    view = cache.numpy().view(np.uint8)
    view[...] = np.random.default_rng(seed).integers(0, 256, view.shape, dtype=np.uint8)


def _verify(dst: KVCache, src: KVCache, ids: range, offset: int = 0) -> None:
    got = dst.numpy().view(np.uint8)[:, offset + ids.start:offset + ids.stop]
    if not np.array_equal(got, src.numpy().view(np.uint8)[:, ids.start:ids.stop]):  # bytes
        raise BenchError("the receiver's blocks differ from the sender's after the loads "
                         "completed")


def _rss() -> dict[str, int]:
    """This process's resident memory in bytes: RssAnon (private), RssShmem (shared memory,
    counted once per mapping) and the others of /proc/self/status."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                name, value, _ = line.split()
                found[name.rstrip(":")] = int(value) * 1024
    if "RssAnon" not in found or "RssShmem" not in found:
        raise BenchError("no RssAnon/RssShmem in /proc/self/status (Linux 4.5 or later)")
    return found
