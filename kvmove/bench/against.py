"""``kvmove-bench transfer --against nixl``: kvmove's workload through NIXL, in the same run.

For each block size and placement of the run, two ``NixlPeer`` processes (a NIXL agent
each; their metadata and descriptor lists relayed through this process) do what the kvmove
rows did, step for step: the same layout, cache size and seeds, so the same block ids on
both sides; WRITE with a notification, the far side checking every byte after it arrives;
READ, checked here; one warm-up and ``iters`` timed iterations, the best reported. Then the
one-block write + notification round trip. ``nixl_side`` says what NIXL is asked to do.

NIXL runs without its progress thread (``nixl_side`` has the measurement), so a side makes
progress only while it polls: during each timed transfer the far side polls for a
notification, the WRITE's own, or for a READ one the near side sends after the timed span
(kvmove's READ notifies no one, so neither does NIXL's inside it).

NIXL runs after kvmove's rows, once kvmove's peer is gone, and before the baselines, so
nothing else competes with either.
"""

from __future__ import annotations

from typing import Any

from kvmove.bench.against_report import APIS, NixlRoundTrip, NixlRow, NixlRun
from kvmove.bench.harness import ChildError
from kvmove.bench.nixl_side import NIXL_INSTALL, NixlPeer
from kvmove.bench.progress import Progress
from kvmove.bench.transfer_report import ROUND_TRIP_WARMUP, BenchConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["count_steps", "probe", "run"]

_NEAR, _FAR = "nixl-near", "nixl-far"
_Result = tuple[dict[str, Any], int]  # NixlSide.transfer's timing, mismatched blocks


def probe(config: BenchConfig) -> str:
    """NIXL's distribution and version, from a process that imported it: run before anything
    is measured, so a missing NIXL ends the run at once.

    Raises:
        ConfigError: NIXL does not import; the message says why and how to install it.
    """
    try:
        with NixlPeer("kvmove-bench-nixl-probe", config.transports, config.timeout) as peer:
            return peer.call("version")
    except ChildError as error:
        if error.kind not in ("ImportError", "ModuleNotFoundError"):
            raise
        raise ConfigError(f"--against nixl needs NIXL's Python package, which does not "
                          f"import here ({error.message}); install it with: "
                          f"{NIXL_INSTALL}") from None


def count_steps(config: BenchConfig) -> int:
    """How many times ``run`` calls ``progress``: each row of each of NIXL's ways, and the
    round trip."""
    return 2 * len(APIS) * len(config.block_sizes) * len(config.placements) + 1


def run(config: BenchConfig, progress: Progress) -> NixlRun:
    """NIXL's rows and round trip for ``config``'s native-cache workload, each row driven
    both ways (``APIS``): one descriptor per (layer, block), and NIXL 1.5's strided lists
    (skipped, saying why, where the installed NIXL refuses them).

    Raises:
        BenchError, ChildError: a NIXL process failed, died, or did not answer in time.
    """
    near = NixlPeer(f"kvmove-bench-{_NEAR}", config.transports, config.timeout)
    try:
        far = NixlPeer(f"kvmove-bench-{_FAR}", config.transports, config.timeout)
        try:
            rows: list[NixlRow] = []
            trip, skipped = None, None
            for api in APIS:
                for block_size in config.block_sizes:
                    try:
                        more, trip = _measure(near, far, config, block_size, progress, trip,
                                              api)
                    except ChildError as error:
                        if api == APIS[0]:
                            raise
                        skipped = f"{api} descriptor lists refused by this NIXL: {error}"
                        break
                    rows += more
            assert trip is not None  # BenchConfig holds at least one block size
            return NixlRun(near.call("version"), tuple(rows), trip, skipped)
        finally:
            far.stop()
    finally:
        near.stop()


def _measure(near: NixlPeer, far: NixlPeer, config: BenchConfig, block_size: int,
             progress: Progress, trip: NixlRoundTrip | None, api: str = APIS[0]
             ) -> tuple[list[NixlRow], NixlRoundTrip]:
    """The rows of one block size driven ``api``'s way, and the round trip if ``trip`` is
    None (after the first placement, as kvmove's)."""
    layout = config.layout(block_size)
    num_blocks = layout.blocks_for(config.num_tokens)
    prep = _connect(near, far, layout, num_blocks * config.spare_factor, config.error_mode,
                    strided=api == "strided")
    rows = []
    for index, placement in enumerate(config.placements):
        seed = config.seed * 1000 + block_size * 10 + index  # kvmove's: the same ids
        local_ids = near.call("place", num_blocks, placement, seed)
        remote_ids = far.call("place", num_blocks, placement, seed + 1)
        for op, measure, op_seed in (("write", _write, seed), ("read", _read, seed + 2)):
            results = measure(near, far, local_ids, remote_ids, op_seed, config)
            rows.append(_row(op, placement, layout, local_ids, results, api, prep))
            progress(f"NIXL ({api}) {op} {placement} block {block_size}")
        if trip is None:
            trip = _round_trip(near, far, local_ids[0], remote_ids[0], layout, config)
            progress("NIXL round trip")
    assert trip is not None
    return rows, trip


def _connect(near: NixlPeer, far: NixlPeer, layout: KVSpec, cache_blocks: int,
             error_mode: str, strided: bool = False) -> float:
    """A fresh NixlSide in each process, each knowing the other's agent and descriptors
    (both ways: the far side writes back in the round trip); the seconds the near side took
    to prepare its two descriptor lists (what a first request waits for)."""
    for peer, name in ((near, _NEAR), (far, _FAR)):
        peer.call("setup", name, layout, cache_blocks, error_mode, strided)
    near_meta, far_meta = near.call("metadata"), far.call("metadata")
    near.call("connect", *far_meta)
    far.call("connect", *near_meta)
    return float(near.call("prep_seconds"))


def _write(near: NixlPeer, far: NixlPeer, local_ids: list[int], remote_ids: list[int],
           seed: int, config: BenchConfig) -> list[_Result]:
    near.call("fill", local_ids, seed)
    results = []
    for i in range(config.iters + 1):
        far.call("wipe", remote_ids)
        tag = f"nixl-write-{seed}-{i}".encode()
        far.send("check_after_notification", tag, remote_ids, local_ids, seed, config.timeout)
        timed = near.call("transfer", "WRITE", local_ids, remote_ids, tag, config.timeout,
                          timeout=2 * config.timeout)
        results.append((timed, far.reply("check_after_notification", 2 * config.timeout)))
    return results


def _read(near: NixlPeer, far: NixlPeer, local_ids: list[int], remote_ids: list[int],
          seed: int, config: BenchConfig) -> list[_Result]:
    far.call("fill", remote_ids, seed)
    results = []
    for i in range(config.iters + 1):
        near.call("wipe", local_ids)
        tag = f"nixl-read-{seed}-{i}".encode()
        far.send("wait_for", tag, config.timeout)
        timed = near.call("transfer", "READ", local_ids, remote_ids, b"", config.timeout,
                          timeout=2 * config.timeout)
        near.call("notify", tag)  # after the timed span: kvmove's READ notifies no one
        far.reply("wait_for", 2 * config.timeout)
        results.append((timed, near.call("mismatches", local_ids, remote_ids, seed)))
    return results


def _row(op: str, placement: str, layout: KVSpec, ids: list[int], results: list[_Result],
         api: str = APIS[0], prep_seconds: float = 0.0) -> NixlRow:
    """The row of the best timed iteration; ``results[0]`` is the warm-up."""
    timed = results[1:]
    best = min((r[0] for r in timed), key=lambda t: t["seconds"])
    return NixlRow(op, placement, layout.block_size, len(ids) * layout.bytes_per_block,
                   len(ids), best["num_descs"], best["make_seconds"], best["post_seconds"],
                   best["seconds"], tuple(r[0]["seconds"] for r in timed),
                   results[0][0]["seconds"], sum(bad for _, bad in results), api,
                   prep_seconds)


def _round_trip(near: NixlPeer, far: NixlPeer, local_id: int, remote_id: int,
                layout: KVSpec, config: BenchConfig) -> NixlRoundTrip:
    """Median of ``round_trips`` pings after ``ROUND_TRIP_WARMUP``, as kvmove's."""
    far.send("echo", remote_id, local_id, config.timeout)
    seconds = near.call("ping", local_id, remote_id, ROUND_TRIP_WARMUP + config.round_trips,
                        config.timeout, timeout=2 * config.timeout)
    far.reply("echo", 2 * config.timeout)
    return NixlRoundTrip.of(layout.bytes_per_block_per_layer, seconds[ROUND_TRIP_WARMUP:])
