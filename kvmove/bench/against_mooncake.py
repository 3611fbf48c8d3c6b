"""``kvmove-bench transfer --against mooncake``: kvmove's workload through Mooncake's transfer
engine, in the same run.

For each block size and placement of the run, two ``MooncakePeer`` processes (a Mooncake
``TransferEngine`` each, tcp protocol; their addresses relayed through this process) do what
the kvmove rows did, step for step: the same layout, cache size and seeds, so the same block
ids on both sides; WRITE with a notification (Mooncake's ``TransferNotify``, sent by the
engine once the batch is done), the far side checking every byte after it arrives; READ,
checked here; one warm-up and ``iters`` timed iterations, the best reported. Then the
one-block write + notification round trip. ``mooncake_side`` says what Mooncake is asked to
do; ``against_common`` holds the driver both libraries share, this module Mooncake's own
steps.

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

from kvmove.bench import against_common as common
from kvmove.bench.against_common import Blocks, Library, Measured, Result
from kvmove.bench.harness import Child
from kvmove.bench.mooncake_report import MooncakeRow, MooncakeRun
from kvmove.bench.mooncake_side import MOONCAKE_INSTALL, MOONCAKE_SETTINGS, MooncakePeer
from kvmove.bench.progress import Progress
from kvmove.bench.transfer_report import BenchConfig
from kvmove.kv_spec import KVSpec

__all__ = ["count_steps", "probe", "run"]


def probe(config: BenchConfig) -> str:
    """Mooncake's distribution and version, from a process that imported it: run before
    anything is measured, so a missing Mooncake ends the run at once.

    Raises:
        ConfigError: Mooncake does not import; the message says why and how to install it.
    """
    return common.probe(lambda: MooncakePeer("kvmove-bench-mooncake-probe", config.timeout),
                        "--against mooncake needs Mooncake's transfer engine",
                        MOONCAKE_INSTALL)


def count_steps(config: BenchConfig) -> int:
    """How many times ``run`` calls ``progress``: each row, and the round trip."""
    return 2 * len(config.block_sizes) * len(config.placements) + 1


def run(config: BenchConfig, progress: Progress) -> MooncakeRun:
    """Mooncake's rows and round trip for ``config``'s native-cache workload.

    Raises:
        BenchError, ChildError: a Mooncake process failed, died, or did not answer in time.
    """
    def open_peer(name: str) -> Child:
        return MooncakePeer(name, config.timeout)

    library = Library("Mooncake", "", "mooncake", _connect, _write, _read, _row)
    with common.peers(open_peer, "mooncake") as (near, far):
        rows: list[MooncakeRow] = []
        trip = None
        for block_size in config.block_sizes:
            more, trip = common.measure(library, near, far, config, block_size, progress,
                                        trip)
            rows += more
        assert trip is not None  # BenchConfig holds at least one block size
        return MooncakeRun(near.call("version"), tuple(rows), trip, _settings())


def _settings() -> dict[str, str]:
    """The Mooncake settings its processes ran with (they inherit this environment)."""
    return {name: os.environ.get(name, value) for name, value in MOONCAKE_SETTINGS.items()}


def _connect(near: Child, far: Child, layout: KVSpec, cache_blocks: int) -> float:
    """Each side knowing the other's address and region; nothing prepared (0.0)."""
    common.exchange(near, far, "mooncake", layout, cache_blocks)
    return 0.0


def _write(blocks: Blocks, tag: str) -> Result:
    """The far side checks only after the timed transfer returned (the engine's own threads
    moved the bytes), once the notification ``tag`` came."""
    timeout = blocks.timeout
    timed = blocks.near.call("transfer", "WRITE", blocks.local_ids, blocks.remote_ids, tag,
                             timeout=2 * timeout)
    bad = blocks.far.call("check_after_notification", tag, blocks.remote_ids,
                          blocks.local_ids, blocks.seed, timeout, timeout=2 * timeout)
    return timed, bad


def _read(blocks: Blocks, tag: str) -> dict[str, Any]:
    """No notification: kvmove's READ notifies no one."""
    timed: dict[str, Any] = blocks.near.call("transfer", "READ", blocks.local_ids,
                                             blocks.remote_ids, "",
                                             timeout=2 * blocks.timeout)
    return timed


def _row(measured: Measured) -> MooncakeRow:
    best = measured.best
    return MooncakeRow(measured.op, measured.placement, measured.block_size, measured.nbytes,
                       measured.num_blocks, best["num_ranges"], best["make_seconds"],
                       best["seconds"], measured.iter_seconds, measured.warmup_seconds,
                       measured.mismatched_blocks)
