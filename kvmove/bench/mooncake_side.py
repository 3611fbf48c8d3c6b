"""The Mooncake side of ``kvmove-bench transfer --against mooncake``: the same cache memory and
data pattern as a kvmove ``Side`` (``PatternCache``), moved by Mooncake's transfer engine
(``mooncake.engine.TransferEngine``, its tcp protocol), in a process of its own.

Why a process of its own for both sides (two ``MooncakePeer`` children; the benchmark's own
process only relays), as for NIXL: Mooncake's wheel bundles its own libraries (glog, asio,
its RPC) and threads; kept out of the process that ran kvmove's agents, the two libraries
never share a process, and a Mooncake crash is a ``ChildError`` naming the process.

What Mooncake is asked to do is what its connectors in SGLang and vLLM do:

- start an engine with no metadata server (``P2PHANDSHAKE``: the peers exchange segment
  descriptors on first use) and register the cache's region once (``register_memory``);
- per transfer, one address triple ``(local, remote, nbytes)`` per (layer, block) of the
  placed blocks, layer by layer in block order, with the triples contiguous on both sides
  merged (Mooncake does not merge them; those connectors group contiguous blocks,
  ``group_concurrent_contiguous``, as kvmove coalesces runs), then one batch call for the
  whole transfer: ``batch_transfer_sync`` with a ``TransferNotify`` for a WRITE,
  ``batch_transfer_sync_read`` for a READ.

The timed span is building and merging the triples + the batch call, as kvmove's is
``write()`` (which validates and coalesces) + ``wait()``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
import time
from types import ModuleType
from typing import Any

import numpy as np

from kvmove.bench.against_host import SideHost, dist_version, expect_notification
from kvmove.bench.harness import Child
from kvmove.bench.pattern import PatternCache
from kvmove.bench.report import BenchError
from kvmove.kv_spec import KVSpec

__all__ = ["MOONCAKE_INSTALL", "MOONCAKE_SETTINGS", "MooncakeHost", "MooncakePeer",
           "MooncakeSide", "import_mooncake_engine"]

# The engine's wheel without CUDA; it links Debian's libibverbs1 even for tcp. Its declared
# dependencies (aiohttp, requests, msgpack) serve Mooncake's store, not the engine.
MOONCAKE_INSTALL = ("apt-get install libibverbs1 && pip install --no-deps "
                    "mooncake-transfer-engine-non-cuda")
_PACKAGE = "mooncake.engine"
_HOST = "127.0.0.1"  # both sides run here (BenchConfig refuses against with connect)
_METADATA = "P2PHANDSHAKE"  # no metadata server: segment descriptors by handshake
_PROTOCOL = "tcp"
_STOP = "stop"  # the notification that ends MooncakeSide.echo
_IDLE_SECONDS = 600.0  # as the kvmove peer
_POLL_SECONDS = 0.0  # between two get_notifies: a yield, not a sleep (2 cores: see poll)
# Mooncake's tcp transport queues at most 1,024 requests per peer (0.3.13; its
# MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) and rejects a batch beyond that ("queue-full": a
# scattered Llama-3.1-8B prompt is 8,000 triples). Deployments that move KV caches over tcp
# raise both queues to their maximum; so do we, so that one batch carries any transfer.
# A value the user sets wins.
MOONCAKE_SETTINGS = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                     "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}


def import_mooncake_engine() -> ModuleType:
    """``mooncake.engine``.

    Raises:
        ImportError: it does not import (not installed, or libibverbs.so.1 missing).
    """
    return importlib.import_module(_PACKAGE)


def _version() -> str:
    """``mooncake-transfer-engine-non-cuda 0.3.13.post1``: the distribution that provided
    ``mooncake``."""
    dists = importlib.metadata.packages_distributions().get("mooncake") or ["mooncake"]
    return dist_version(dists[0])


class MooncakeSide(PatternCache):
    """A ``PatternCache`` whose region is registered with a Mooncake ``TransferEngine``.

    Args:
        engine: ``import_mooncake_engine()``.
        name: how its notifications name it.
    """

    def __init__(self, engine: ModuleType, name: str, layout: KVSpec, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        self.api = engine
        self.name = name
        self.engine = engine.TransferEngine()
        _check(self.engine.initialize(f"{_HOST}:0", _METADATA, _PROTOCOL, ""),
               f"initialize on {_HOST} ({_PROTOCOL}, {_METADATA})")
        region = self.cache.region
        assert region is not None  # a cache kvmove allocates has one
        self.base = region.addr
        _check(self.engine.register_memory(region.addr, region.nbytes),
               f"register_memory of {region.nbytes:,} B")
        self._registered = True
        # [num_layers, num_blocks] byte offsets of each (layer, block) in the region: the
        # far side's cache has the same layout, so the same offsets from its own base.
        cache = self.cache
        self.offsets = np.array([[cache.offset(layer, block) for block in
                                  range(cache.num_blocks)] for layer in
                                 range(cache.num_layers)], dtype=np.uint64)
        self.remote = ""
        self.remote_base = 0

    def metadata(self) -> tuple[str, int]:
        """What the other side's ``connect`` needs: this engine's address and region base."""
        return f"{_HOST}:{self.engine.get_rpc_port()}", self.base

    def connect(self, remote: str, remote_base: int) -> None:
        self.remote, self.remote_base = remote, remote_base

    def triples(self, local_ids: list[int], remote_ids: list[int], layers: int | None = None
                ) -> tuple[list[int], list[int], list[int]]:
        """Local addresses, remote addresses and byte counts of every (layer, block) of
        ``local_ids`` to or from ``remote_ids`` (first ``layers`` layers, default all),
        layer-major, neighbours contiguous on both sides merged into one triple."""
        rows = self.offsets[:layers]  # [:None]: every layer
        local = (np.uint64(self.base) + rows[:, local_ids]).ravel()
        remote = (np.uint64(self.remote_base) + rows[:, remote_ids]).ravel()
        nbytes = np.uint64(self.cache.block_nbytes)
        follows = (local[1:] == local[:-1] + nbytes) & (remote[1:] == remote[:-1] + nbytes)
        starts = np.flatnonzero(np.concatenate(([True], ~follows)))
        counts = np.diff(np.append(starts, len(local)))
        return (local[starts].tolist(), remote[starts].tolist(),
                (counts * self.cache.block_nbytes).tolist())

    def transfer(self, op: str, local_ids: list[int], remote_ids: list[int],
                 notify: str) -> dict[str, Any]:
        """Times one ``op`` ("WRITE", with the notification ``notify``, or "READ") of every
        layer of ``local_ids`` to or from ``remote_ids`` (same order): triples + one batch.

        Returns:
            ``seconds`` (the whole), ``make_seconds`` (building the triples) and
            ``num_ranges`` (the triples posted).
        """
        start = time.perf_counter()
        local, remote, nbytes = self.triples(local_ids, remote_ids)
        made = time.perf_counter()
        self._batch(op, local, remote, nbytes, notify)
        end = time.perf_counter()
        return {"seconds": end - start, "make_seconds": made - start,
                "num_ranges": len(local)}

    def _batch(self, op: str, local: list[int], remote: list[int], nbytes: list[int],
               notify: str) -> None:
        if op == "WRITE":
            message = self.api.TransferNotify(self.name, notify)
            code = self.engine.batch_transfer_sync(self.remote, local, remote, nbytes,
                                                   self.api.TransferOpcode.Write, message)
        else:
            code = self.engine.batch_transfer_sync_read(self.remote, local, remote, nbytes)
        _check(code, f"{op} of {len(local):,} ranges, {sum(nbytes):,} B, with {self.remote}")

    def wait_notification(self, timeout: float) -> str:
        """The next notification's message (polled: Mooncake has no blocking wait). The
        poll yields between tries: on a 2-core machine a spinning far side would take a core
        from Mooncake's own threads."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            notes = self.engine.get_notifies()
            if notes:
                if len(notes) > 1:
                    raise BenchError(f"expected one Mooncake notification, got {len(notes)}: "
                                     f"{[n.msg for n in notes[:3]]}")
                return str(notes[0].msg)
            time.sleep(_POLL_SECONDS)
        raise BenchError(f"no Mooncake notification from {self.remote!r} within {timeout:g} s")

    def check_after_notification(self, tag: str, ids: list[int], src_ids: list[int],
                                 seed: int, timeout: float) -> int:
        """Waits for the notification ``tag``, then counts ``mismatches``."""
        expect_notification("Mooncake", tag, self.wait_notification(timeout))
        return self.mismatches(ids, src_ids, seed)

    def _one_block(self, local_id: int, remote_id: int, notify: str) -> None:
        """Writes block ``local_id`` of layer 0 to ``remote_id`` with a notification."""
        local, remote, nbytes = self.triples([local_id], [remote_id], layers=1)
        self._batch("WRITE", local, remote, nbytes, notify)

    def echo(self, local_id: int, remote_id: int, timeout: float) -> int:
        """Answers each notification with a one-block write of layer 0 and a notification,
        until the message is the stop message; returns how many it answered."""
        answered = 0
        while self.wait_notification(timeout) != _STOP:
            self._one_block(local_id, remote_id, "pong")
            answered += 1
        return answered

    def ping(self, local_id: int, remote_id: int, count: int, timeout: float) -> list[float]:
        """``count`` round trips with a side running ``echo``: each a one-block write with a
        notification, then the wait for the answer; returns each round trip's seconds, then
        stops the echo (with one more write: Mooncake's Python API sends a notification only
        with a transfer)."""
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            self._one_block(local_id, remote_id, "ping")
            self.wait_notification(timeout)
            seconds.append(time.perf_counter() - start)
        self._one_block(local_id, remote_id, _STOP)
        return seconds

    def close(self) -> None:
        if self._registered:
            self._registered = False
            self.engine.unregister_memory(self.base)


def _check(code: int, what: str) -> None:
    """Mooncake's calls return a negative code on failure and say why only in its log."""
    if code < 0:
        raise BenchError(f"Mooncake {what} failed (code {code}; MC_LOG_LEVEL=INFO and its "
                         "log on stderr for the reason)")


# The MooncakeSide's verbs a MooncakePeer runs on command (``setup`` first).
_SIDE_VERBS = ("metadata", "connect", "place", "fill", "wipe", "mismatches", "transfer",
               "check_after_notification", "echo", "ping")


class MooncakeHost(SideHost):
    """What a Mooncake process hosts: Mooncake imported (``version`` says which), then per
    ``setup`` a fresh ``MooncakeSide`` (closing the last one) whose verbs run on command.

    Args:
        timeout: deadline in seconds of every Mooncake transfer (``MC_TRANSFER_TIMEOUT``).
    """

    verbs = _SIDE_VERBS
    side_kind = "MooncakeSide"

    def __init__(self, timeout: float) -> None:
        super().__init__()
        # Mooncake logs (glog) to stderr; anything it prints to stdout, which this process
        # shares with the report, goes to stderr too.
        os.dup2(2, 1)
        for name, value in MOONCAKE_SETTINGS.items():
            os.environ.setdefault(name, value)
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(math.ceil(timeout)))
        # Its INFO and WARNING lines (a dozen per engine: no RDMA device, tcp chosen) would
        # bury the progress bar; its errors still show (ERROR is its quietest level), among
        # them one "Local segment descriptor not found" per engine at start: its own, benign.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self.api = import_mooncake_engine()

    def version(self) -> str:
        return _version()

    def setup(self, name: str, layout: KVSpec, num_blocks: int) -> None:
        self._replace(lambda: MooncakeSide(self.api, name, layout, num_blocks))


class MooncakePeer(Child):
    """A process hosting a ``MooncakeHost`` (``harness.Child``: every reply has a deadline).

    Raises:
        ChildError: Mooncake did not import there (``kind`` "ImportError", ``message``
            why), or the process failed to start.
    """

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(MooncakeHost, timeout, name=name,
                         label=f"Mooncake process {name!r}", timeout=timeout,
                         idle_exit=_IDLE_SECONDS)
