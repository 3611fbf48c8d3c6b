"""``kvmove-bench transfer --against nixl``: kvmove's workload through NIXL, in the same run.

For each block size and placement of the run, two ``NixlPeer`` processes (a NIXL agent
each; their metadata and descriptor lists relayed through this process) do what the kvmove
rows did, step for step: the same layout, cache size and seeds, so the same block ids on
both sides; WRITE with a notification, the far side checking every byte after it arrives;
READ, checked here; one warm-up and ``iters`` timed iterations, the best reported. Then the
one-block write + notification round trip. ``nixl_side`` says what NIXL is asked to do;
``against_common`` holds the driver both libraries share, this module NIXL's own steps.

NIXL runs without its progress thread (``nixl_side`` has the measurement), so a side makes
progress only while it polls: during each timed transfer the far side polls for a
notification, the WRITE's own, or for a READ one the near side sends after the timed span
(kvmove's READ notifies no one, so neither does NIXL's inside it).

NIXL runs after kvmove's rows, once kvmove's peer is gone, and before the baselines, so
nothing else competes with either.
"""

from __future__ import annotations

from typing import Any

from kvmove.bench import against_common as common
from kvmove.bench.against_common import Blocks, Library, Measured, Result
from kvmove.bench.against_report import APIS, NixlRow, NixlRun
from kvmove.bench.harness import Child, ChildError
from kvmove.bench.nixl_side import NIXL_INSTALL, NixlPeer
from kvmove.bench.progress import Progress
from kvmove.bench.transfer_report import BenchConfig
from kvmove.kv_spec import KVSpec

__all__ = ["count_steps", "probe", "run"]


def probe(config: BenchConfig) -> str:
    """NIXL's distribution and version, from a process that imported it: run before anything
    is measured, so a missing NIXL ends the run at once.

    Raises:
        ConfigError: NIXL does not import; the message says why and how to install it.
    """
    return common.probe(
        lambda: NixlPeer("kvmove-bench-nixl-probe", config.transports, config.timeout),
        "--against nixl needs NIXL's Python package", NIXL_INSTALL)


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
    def open_peer(name: str) -> Child:
        return NixlPeer(name, config.transports, config.timeout)

    with common.peers(open_peer, "nixl") as (near, far):
        rows: list[NixlRow] = []
        trip, skipped = None, None
        for api in APIS:
            library = _library(api, config.error_mode)
            for block_size in config.block_sizes:
                try:
                    more, trip = common.measure(library, near, far, config, block_size,
                                                progress, trip)
                except ChildError as error:
                    if api == APIS[0]:
                        raise
                    skipped = f"{api} descriptor lists refused by this NIXL: {error}"
                    break
                rows += more
        assert trip is not None  # BenchConfig holds at least one block size
        return NixlRun(near.call("version"), tuple(rows), trip, skipped)


def _library(api: str, error_mode: str) -> Library[NixlRow]:
    """NIXL driven ``api``'s way (APIS), its UCX backend in ``error_mode``."""
    def connect(near: Child, far: Child, layout: KVSpec, cache_blocks: int) -> float:
        """Also the seconds the near side took to prepare its two descriptor lists (what a
        first request waits for)."""
        common.exchange(near, far, "nixl", layout, cache_blocks, error_mode,
                        api == "strided")
        return float(near.call("prep_seconds"))

    def row(measured: Measured) -> NixlRow:
        return _row(measured, api)

    return Library("NIXL", api, "nixl", connect, _write, _read, row)


def _write(blocks: Blocks, tag: str) -> Result:
    """The far side polls for the notification during the transfer (NIXL makes progress
    only while a side polls) and checks every byte once it came."""
    note, timeout = tag.encode(), blocks.timeout
    blocks.far.send("check_after_notification", note, blocks.remote_ids, blocks.local_ids,
                    blocks.seed, timeout)
    timed = blocks.near.call("transfer", "WRITE", blocks.local_ids, blocks.remote_ids, note,
                             timeout, timeout=2 * timeout)
    return timed, blocks.far.reply("check_after_notification", 2 * timeout)


def _read(blocks: Blocks, tag: str) -> dict[str, Any]:
    """The far side polls during the transfer, for a notification the near side sends
    after the timed span: kvmove's READ notifies no one, so neither does NIXL's inside it."""
    timeout = blocks.timeout
    blocks.far.send("wait_for", tag.encode(), timeout)
    timed: dict[str, Any] = blocks.near.call("transfer", "READ", blocks.local_ids,
                                             blocks.remote_ids, b"", timeout,
                                             timeout=2 * timeout)
    blocks.near.call("notify", tag.encode())
    blocks.far.reply("wait_for", 2 * timeout)
    return timed


def _row(measured: Measured, api: str) -> NixlRow:
    best = measured.best
    return NixlRow(measured.op, measured.placement, measured.block_size, measured.nbytes,
                   measured.num_blocks, best["num_descs"], best["make_seconds"],
                   best["post_seconds"], best["seconds"], measured.iter_seconds,
                   measured.warmup_seconds, measured.mismatched_blocks, api,
                   measured.prep_seconds)
