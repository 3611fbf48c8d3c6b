"""The driver ``kvmove-bench transfer --against``'s libraries share: kvmove's workload run
through another library's two processes (``against_host``: what those processes host).

The driver (``probe``, ``peers``, ``measure``, ``round_trip``) does what kvmove's rows did,
step for step, for any library whose processes answer the same verbs
(``against_host.SideHost``): the same layout, cache size and seeds, so the same block ids on
both sides; WRITE, checked by the far side after its notification; READ, checked here; one
warm-up and ``iters`` timed iterations, the best reported; then the one-block write +
notification round trip. A ``Library`` carries what differs: how its sides connect, its one
WRITE and one READ, and its row type.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvmove.bench.harness import Child, ChildError
from kvmove.bench.progress import Progress
from kvmove.bench.report import RoundTrip
from kvmove.bench.transfer_report import ROUND_TRIP_WARMUP, BenchConfig
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

__all__ = ["Blocks", "Library", "Measured", "Result", "exchange", "measure", "peers", "probe",
           "round_trip"]

Row = TypeVar("Row")
Result = tuple[dict[str, Any], int]  # a side's transfer timing, mismatched blocks


def probe(open_peer: Callable[[], Child], needs: str, install: str) -> str:
    """The library's distribution and version, from a process that imported it: run before
    anything is measured, so a missing library ends the run at once.

    Args:
        open_peer: starts the library's probe process.
        needs: what the message says is missing ("--against nixl needs NIXL's Python
            package").

    Raises:
        ConfigError: the library does not import; the message says why and ``install``.
    """
    try:
        with open_peer() as peer:
            return peer.call("version")
    except ChildError as error:
        if error.kind not in ("ImportError", "ModuleNotFoundError"):
            raise
        raise ConfigError(f"{needs}, which does not import here ({error.message}); install "
                          f"it with: {install}") from None


@contextlib.contextmanager
def peers(open_peer: Callable[[str], Child], slug: str) -> Iterator[tuple[Child, Child]]:
    """The near and far processes (``kvmove-bench-{slug}-near``, ``-far``), stopped on exit,
    the far one first."""
    near = open_peer(f"kvmove-bench-{slug}-near")
    try:
        far = open_peer(f"kvmove-bench-{slug}-far")
        try:
            yield near, far
        finally:
            far.stop()
    finally:
        near.stop()


def exchange(near: Child, far: Child, slug: str, *setup: Any) -> None:
    """A fresh side in each process (``setup(name, *setup)``), each knowing the other's
    metadata (both ways: the far side writes back in the round trip)."""
    for peer, end in ((near, "near"), (far, "far")):
        peer.call("setup", f"{slug}-{end}", *setup)
    near_meta, far_meta = near.call("metadata"), far.call("metadata")
    near.call("connect", *far_meta)
    far.call("connect", *near_meta)


@dataclass(frozen=True, slots=True)
class Blocks:
    """One row's transfer: the near side's ``local_ids`` to or from the far side's
    ``remote_ids`` (same order), the data seeded ``seed``; ``timeout`` in seconds."""

    near: Child
    far: Child
    local_ids: list[int]
    remote_ids: list[int]
    seed: int
    timeout: float


@dataclass(frozen=True, slots=True)
class Measured:
    """One row's iterations, for a ``Library.row``: the best timed one's timing (``best``,
    as the side's ``transfer`` returned it), every timed one's seconds, the warm-up's, and
    the mismatched blocks over all of them; ``prep_seconds`` as ``Library.connect`` said."""

    op: str
    placement: str
    block_size: int
    nbytes: int
    num_blocks: int
    best: dict[str, Any]
    iter_seconds: tuple[float, ...]
    warmup_seconds: float
    mismatched_blocks: int
    prep_seconds: float


@dataclass(frozen=True, slots=True)
class Library(Generic[Row]):
    """What differs between two libraries under the driver.

    Attributes:
        name: how progress names it ("NIXL").
        way: how progress names this way of driving it ("strided"; "" for its only way).
        slug: its process names and notification tags ("nixl").
        connect: ``(near, far, layout, cache_blocks)``: fresh sides that know each other;
            returns the seconds the near side spent preparing (0.0 for none).
        write: one timed WRITE of ``Blocks`` with the notification ``tag``, its destination
            wiped: the timing and the far side's mismatched blocks.
        read: one timed READ of ``Blocks`` (``tag`` for a notification after it), its
            destination wiped: the timing (the driver counts the mismatches).
        row: the library's row of a ``Measured``.
    """

    name: str
    way: str
    slug: str
    connect: Callable[[Child, Child, KVSpec, int], float]
    write: Callable[[Blocks, str], Result]
    read: Callable[[Blocks, str], dict[str, Any]]
    row: Callable[[Measured], Row]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.way})" if self.way else self.name


def measure(library: Library[Row], near: Child, far: Child, config: BenchConfig,
            block_size: int, progress: Progress, trip: RoundTrip | None
            ) -> tuple[list[Row], RoundTrip]:
    """The rows of one block size, and the round trip if ``trip`` is None (after the first
    placement, as kvmove's)."""
    layout = config.layout(block_size)
    num_blocks = layout.blocks_for(config.num_tokens)
    prep = library.connect(near, far, layout, num_blocks * config.spare_factor)
    rows = []
    for index, placement in enumerate(config.placements):
        seed = config.seed * 1000 + block_size * 10 + index  # kvmove's: the same ids
        local_ids = near.call("place", num_blocks, placement, seed)
        remote_ids = far.call("place", num_blocks, placement, seed + 1)
        for op, op_seed in (("write", seed), ("read", seed + 2)):
            blocks = Blocks(near, far, local_ids, remote_ids, op_seed, config.timeout)
            results = _iterations(library, op, blocks, config.iters)
            rows.append(library.row(_measured(op, placement, layout, local_ids, results,
                                              prep)))
            progress(f"{library.label} {op} {placement} block {block_size}")
        if trip is None:
            trip = round_trip(near, far, local_ids[0], remote_ids[0], layout, config)
            progress(f"{library.name} round trip")
    assert trip is not None
    return rows, trip


def _iterations(library: Library[Any], op: str, blocks: Blocks, iters: int) -> list[Result]:
    """The warm-up and ``iters`` timed ``op``s ("write": near to far, "read": far to near):
    the source filled once, the destination wiped before each."""
    write = op == "write"
    ends = ((blocks.near, blocks.local_ids), (blocks.far, blocks.remote_ids))
    (source, source_ids), (destination, destination_ids) = ends if write else ends[::-1]
    source.call("fill", source_ids, blocks.seed)
    results = []
    for i in range(iters + 1):
        destination.call("wipe", destination_ids)
        tag = f"{library.slug}-{op}-{blocks.seed}-{i}"
        results.append(library.write(blocks, tag) if write else _read(library, blocks, tag))
    return results


def _read(library: Library[Any], blocks: Blocks, tag: str) -> Result:
    """One ``library.read``, then the near side's count of the blocks it got wrong."""
    timed = library.read(blocks, tag)
    return timed, blocks.near.call("mismatches", blocks.local_ids, blocks.remote_ids,
                                   blocks.seed)


def _measured(op: str, placement: str, layout: KVSpec, ids: list[int],
              results: list[Result], prep_seconds: float) -> Measured:
    """The best timed iteration of ``results``; ``results[0]`` is the warm-up."""
    timed = results[1:]
    best = min((r[0] for r in timed), key=lambda t: t["seconds"])
    return Measured(op, placement, layout.block_size, len(ids) * layout.bytes_per_block,
                    len(ids), best, tuple(r[0]["seconds"] for r in timed),
                    results[0][0]["seconds"], sum(bad for _, bad in results), prep_seconds)


def round_trip(near: Child, far: Child, local_id: int, remote_id: int, layout: KVSpec,
               config: BenchConfig) -> RoundTrip:
    """Median of ``round_trips`` pings after ``ROUND_TRIP_WARMUP``, as kvmove's."""
    far.send("echo", remote_id, local_id, config.timeout)
    seconds = near.call("ping", local_id, remote_id, ROUND_TRIP_WARMUP + config.round_trips,
                        config.timeout, timeout=2 * config.timeout)
    far.reply("echo", 2 * config.timeout)
    return RoundTrip.of(layout.bytes_per_block_per_layer, seconds[ROUND_TRIP_WARMUP:])
