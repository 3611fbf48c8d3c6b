"""``kvmove-bench transfer --against mooncake``: kvmove's workload through Mooncake's transfer
engine, in the same run.

For each block size and placement of the run, two ``MooncakePeer`` processes (a Mooncake
``TransferEngine`` each, tcp protocol; their addresses relayed through this process) do what
the kvmove rows did, step for step: the same layout, cache size and seeds, so the same block
ids on both sides; WRITE with a notification (Mooncake's ``TransferNotify``, sent by the
engine once the batch is done), the far side checking every byte after it arrives; READ,
checked here; one warm-up and ``iters`` timed iterations, the best reported. Then the
one-block write + notification round trip. ``mooncake_side`` says what Mooncake is asked to
do.

As in kvmove's rows, the far side is asked to check only after the timed transfer returned:
Mooncake's engine moves bytes on its own threads, so the far side need not poll during it
(unlike NIXL without its progress thread), and on a 2-core machine a far side polling for
the notification would take a core from them.

Mooncake runs after kvmove's rows, once kvmove's peer is gone, and before the baselines, so
nothing else competes with either.
"""

from __future__ import annotations

import os
from typing import Any

from kvmove.bench.harness import ChildError
from kvmove.bench.mooncake_report import MooncakeRow, MooncakeRun
from kvmove.bench.mooncake_side import MOONCAKE_INSTALL, MOONCAKE_SETTINGS, MooncakePeer
from kvmove.bench.progress import Progress
from kvmove.bench.report import RoundTrip
from kvmove.bench.transfer_report import ROUND_TRIP_WARMUP, BenchConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["count_steps", "probe", "run"]

_NEAR, _FAR = "mooncake-near", "mooncake-far"
_Result = tuple[dict[str, Any], int]  # MooncakeSide.transfer's timing, mismatched blocks


def probe(config: BenchConfig) -> str:
    """Mooncake's distribution and version, from a process that imported it: run before
    anything is measured, so a missing Mooncake ends the run at once.

    Raises:
        ConfigError: Mooncake does not import; the message says why and how to install it.
    """
    try:
        with MooncakePeer("kvmove-bench-mooncake-probe", config.timeout) as peer:
            return peer.call("version")
    except ChildError as error:
        if error.kind not in ("ImportError", "ModuleNotFoundError"):
            raise
        raise ConfigError(f"--against mooncake needs Mooncake's transfer engine, which does "
                          f"not import here ({error.message}); install it with: "
                          f"{MOONCAKE_INSTALL}") from None


def count_steps(config: BenchConfig) -> int:
    """How many times ``run`` calls ``progress``: each row, and the round trip."""
    return 2 * len(config.block_sizes) * len(config.placements) + 1


def run(config: BenchConfig, progress: Progress) -> MooncakeRun:
    """Mooncake's rows and round trip for ``config``'s native-cache workload.

    Raises:
        BenchError, ChildError: a Mooncake process failed, died, or did not answer in time.
    """
    near = MooncakePeer(f"kvmove-bench-{_NEAR}", config.timeout)
    try:
        far = MooncakePeer(f"kvmove-bench-{_FAR}", config.timeout)
        try:
            rows: list[MooncakeRow] = []
            trip = None
            for block_size in config.block_sizes:
                more, trip = _measure(near, far, config, block_size, progress, trip)
                rows += more
            assert trip is not None  # BenchConfig holds at least one block size
            return MooncakeRun(near.call("version"), tuple(rows), trip, _settings())
        finally:
            far.stop()
    finally:
        near.stop()


def _settings() -> dict[str, str]:
    """The Mooncake settings its processes ran with (they inherit this environment)."""
    return {name: os.environ.get(name, value) for name, value in MOONCAKE_SETTINGS.items()}


def _measure(near: MooncakePeer, far: MooncakePeer, config: BenchConfig, block_size: int,
             progress: Progress, trip: RoundTrip | None
             ) -> tuple[list[MooncakeRow], RoundTrip]:
    """The rows of one block size, and the round trip if ``trip`` is None (after the first
    placement, as kvmove's)."""
    layout = config.layout(block_size)
    num_blocks = layout.blocks_for(config.num_tokens)
    _connect(near, far, layout, num_blocks * config.spare_factor)
    rows = []
    for index, placement in enumerate(config.placements):
        seed = config.seed * 1000 + block_size * 10 + index  # kvmove's: the same ids
        local_ids = near.call("place", num_blocks, placement, seed)
        remote_ids = far.call("place", num_blocks, placement, seed + 1)
        for op, measure, op_seed in (("write", _write, seed), ("read", _read, seed + 2)):
            results = measure(near, far, local_ids, remote_ids, op_seed, config)
            rows.append(_row(op, placement, layout, local_ids, results))
            progress(f"Mooncake {op} {placement} block {block_size}")
        if trip is None:
            trip = _round_trip(near, far, local_ids[0], remote_ids[0], layout, config)
            progress("Mooncake round trip")
    assert trip is not None
    return rows, trip


def _connect(near: MooncakePeer, far: MooncakePeer, layout: KVSpec, cache_blocks: int) -> None:
    """A fresh MooncakeSide in each process, each knowing the other's address and region
    (both ways: the far side writes back in the round trip)."""
    for peer, name in ((near, _NEAR), (far, _FAR)):
        peer.call("setup", name, layout, cache_blocks)
    near_meta, far_meta = near.call("metadata"), far.call("metadata")
    near.call("connect", *far_meta)
    far.call("connect", *near_meta)


def _write(near: MooncakePeer, far: MooncakePeer, local_ids: list[int], remote_ids: list[int],
           seed: int, config: BenchConfig) -> list[_Result]:
    near.call("fill", local_ids, seed)
    results = []
    for i in range(config.iters + 1):
        far.call("wipe", remote_ids)
        tag = f"mooncake-write-{seed}-{i}"
        timed = near.call("transfer", "WRITE", local_ids, remote_ids, tag,
                          timeout=2 * config.timeout)
        bad = far.call("check_after_notification", tag, remote_ids, local_ids, seed,
                       config.timeout, timeout=2 * config.timeout)
        results.append((timed, bad))
    return results


def _read(near: MooncakePeer, far: MooncakePeer, local_ids: list[int], remote_ids: list[int],
          seed: int, config: BenchConfig) -> list[_Result]:
    far.call("fill", remote_ids, seed)
    results = []
    for _ in range(config.iters + 1):
        near.call("wipe", local_ids)
        timed = near.call("transfer", "READ", local_ids, remote_ids, "",
                          timeout=2 * config.timeout)
        results.append((timed, near.call("mismatches", local_ids, remote_ids, seed)))
    return results


def _row(op: str, placement: str, layout: KVSpec, ids: list[int],
         results: list[_Result]) -> MooncakeRow:
    """The row of the best timed iteration; ``results[0]`` is the warm-up."""
    timed = results[1:]
    best = min((r[0] for r in timed), key=lambda t: t["seconds"])
    return MooncakeRow(op, placement, layout.block_size, len(ids) * layout.bytes_per_block,
                       len(ids), best["num_ranges"], best["make_seconds"], best["seconds"],
                       tuple(r[0]["seconds"] for r in timed), results[0][0]["seconds"],
                       sum(bad for _, bad in results))


def _round_trip(near: MooncakePeer, far: MooncakePeer, local_id: int, remote_id: int,
                layout: KVSpec, config: BenchConfig) -> RoundTrip:
    """Median of ``round_trips`` pings after ``ROUND_TRIP_WARMUP``, as kvmove's."""
    far.send("echo", remote_id, local_id, config.timeout)
    seconds = near.call("ping", local_id, remote_id, ROUND_TRIP_WARMUP + config.round_trips,
                        config.timeout, timeout=2 * config.timeout)
    far.reply("echo", 2 * config.timeout)
    return RoundTrip.of(layout.bytes_per_block_per_layer, seconds[ROUND_TRIP_WARMUP:])
