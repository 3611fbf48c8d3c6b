"""The NIXL side of ``kvmove-bench transfer --against nixl``: the same cache memory and data
pattern as a kvmove ``Side`` (``PatternCache``), moved by a NIXL agent, in a process of its own.

Why a process of its own for *both* NIXL sides (two ``NixlPeer`` children; the benchmark's
own process only relays): NIXL's wheel bundles its own UCX (1.23 in NIXL 1.5.1) beside the
one kvmove links. Keeping NIXL out of the process that ran kvmove's agents means the two
libraries never share a process, and a NIXL crash is a ``ChildError`` naming the process, not
a dead benchmark.

What NIXL is asked to do is what its own connectors do (vLLM's NixlConnector):

- register the cache's region once (``register_memory``, DRAM);
- prepare one descriptor per (layer, block) of the whole cache, on each side, once
  (``prep_xfer_dlist``; the far side's list comes with its metadata through the parent);
- per transfer, make a request from the indices of the placed blocks, layer by layer in block
  order (``make_prepped_xfer``: NIXL merges descriptors contiguous on both sides, as kvmove
  coalesces runs), post it (``transfer``) and poll ``check_xfer_state`` until it is done.

The timed span is make + post + poll, as kvmove's is ``write()`` (which validates and
coalesces) + ``wait()``; the indices are computed before it (the engine has them at hand).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from types import ModuleType
from typing import Any

import numpy as np

from kvmove.bench.against_host import SideHost, dist_version, expect_notification
from kvmove.bench.harness import Child
from kvmove.bench.pattern import PatternCache
from kvmove.bench.perftest import agent_ucx_env
from kvmove.bench.report import BenchError
from kvmove.kv_spec import KVSpec

__all__ = ["NIXL_INSTALL", "NixlHost", "NixlPeer", "NixlSide", "import_nixl_api"]

# The smallest install that works: the backend wheel needs only numpy. (The meta package
# `nixl` pulls both CUDA builds and torch.)
NIXL_INSTALL = "pip install --no-deps nixl-cu13"
# `nixl` (the meta package) re-exports one backend wheel's modules; `nixl-cu13` alone
# installs only `nixl_cu13`, whose `_api` is the same public API.
_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
_MEM = "DRAM"
_STOP = b"stop"  # the notification that ends NixlSide.echo
_IDLE_SECONDS = 600.0  # as the kvmove peer
# NIXL's own progress thread is off: both sides poll instead (check_xfer_state and
# get_new_notifs progress the worker; the far side polls for the notification during every
# transfer). We compare against NIXL at its best, and on this machine (2 cores, loaded) its
# default thread made it slower: with it, 0.30-0.51 GB/s for the rows (Llama-3.1-8B, 4,000
# tokens) and a one-block write + notification ~64 ms one way; without it 0.68-1.42 GB/s and
# ~56 us, the same run.
_PROGRESS_THREAD = False


def import_nixl_api() -> ModuleType:
    """NIXL's Python API module (``nixl._api`` or a backend wheel's ``nixl_cuXX._api``).

    Raises:
        ImportError: none imports; the message names each package tried and why it failed.
    """
    failures = []
    for package in _PACKAGES:
        try:
            return importlib.import_module(f"{package}._api")
        except ImportError as error:
            failures.append(f"{package}: {error}")
    raise ImportError("; ".join(failures))


def _version(api: ModuleType) -> str:
    """``nixl-cu13 1.5.1``: the distribution that provided ``api``."""
    return dist_version(api.__name__.split(".")[0].replace("_", "-"))


class NixlSide(PatternCache):
    """A ``PatternCache`` whose region is registered with a NIXL agent named ``name``.

    Args:
        api: ``import_nixl_api()``.
        error_mode: NIXL's UCX backend ``ucx_error_handling_mode`` ("peer" or "none", as
            kvmove's ``error_mode``; NIXL's default is "peer").
    """

    def __init__(self, api: ModuleType, name: str, layout: KVSpec, num_blocks: int,
                 error_mode: str, strided: bool = False) -> None:
        super().__init__(layout, num_blocks)
        self.strided = strided
        config = api.nixl_agent_config(enable_prog_thread=_PROGRESS_THREAD, backends=[],
                                       capture_telemetry=True)
        self.agent = api.nixl_agent(name, config)
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode})
        region = self.cache.region
        assert region is not None  # a cache kvmove allocates has one
        self._registered = self.agent.register_memory(
            [(region.addr, region.nbytes, 0, "")], _MEM)
        self.remote = ""
        self._local: Any = None
        self._remote: Any = None
        self.prep_seconds = 0.0

    def descriptors(self) -> np.ndarray:
        """``[num_layers * num_blocks, 3]`` uint64 ``(addr, nbytes, device)``: one per
        (layer, block), layer-major, so index ``layer * num_blocks + block``. ``strided``:
        NIXL 1.5's compressed form of the same list, ``[num_layers, 5]`` ``(addr, nbytes,
        device, stride, count)``: a layer's blocks, ``stride`` bytes apart (vLLM's
        NixlConnector prepares its lists so since vllm#55157); the indices are the same."""
        cache = self.cache
        assert cache.region is not None  # as in __init__
        addr = cache.region.addr
        if self.strided:
            rows = []
            for layer in range(cache.num_layers):
                first = cache.offset(layer, 0)
                stride = cache.offset(layer, 1) - first if cache.num_blocks > 1 else \
                    cache.block_nbytes
                if any(cache.offset(layer, b) != first + b * stride
                       for b in range(cache.num_blocks)):
                    raise BenchError(f"layer {layer}'s blocks are not evenly spaced: no "
                                     "strided descriptor describes them")
                rows.append((addr + first, cache.block_nbytes, 0, stride, cache.num_blocks))
            return np.array(rows, dtype=np.uint64)
        return np.array([(addr + cache.offset(layer, block), cache.block_nbytes, 0)
                         for layer in range(cache.num_layers)
                         for block in range(cache.num_blocks)], dtype=np.uint64)

    def metadata(self) -> tuple[bytes, np.ndarray]:
        """What the other side's ``connect`` needs: the agent's metadata and descriptors."""
        return self.agent.get_agent_metadata(), self.descriptors()

    def connect(self, metadata: bytes, remote_descriptors: np.ndarray) -> str:
        """Loads the other side's metadata and prepares both descriptor lists; returns the
        other agent's name."""
        name = self.agent.add_remote_agent(metadata)
        # bytes from add_remote_agent, str as get_new_notifs' keys
        self.remote = name.decode() if isinstance(name, bytes) else name
        start = time.perf_counter()   # both lists: what a first request waits for
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.descriptors(), _MEM)
        self._remote = self.agent.prep_xfer_dlist(self.remote, remote_descriptors, _MEM)
        self.prep_seconds = time.perf_counter() - start
        return self.remote

    def _indices(self, ids: list[int], layers: range | None = None) -> np.ndarray:
        """Indices into the prepared lists of ``ids`` in ``layers`` (all), layer-major."""
        layers = layers if layers is not None else range(self.cache.num_layers)
        rows = np.asarray(layers, dtype=np.int64)[:, None] * self.cache.num_blocks
        return (rows + np.asarray(ids, dtype=np.int64)[None, :]).ravel().astype(np.int32)

    def transfer(self, op: str, local_ids: list[int], remote_ids: list[int], notify: bytes,
                 timeout: float) -> dict[str, Any]:
        """Times one ``op`` ("WRITE" or "READ") of every layer of ``local_ids`` to or from
        ``remote_ids`` (same order): make + post + poll until done.

        Returns:
            ``seconds`` (the whole), ``make_seconds``, ``post_seconds`` (the ``transfer``
            call), and NIXL's telemetry: ``num_descs`` (after merging) and ``nbytes``.
        """
        local, remote = self._indices(local_ids), self._indices(remote_ids)
        start = time.perf_counter()
        handle = self.agent.make_prepped_xfer(op, self._local, local, self._remote, remote,
                                              notify)
        try:
            made = time.perf_counter()
            state = self.agent.transfer(handle)
            posted = time.perf_counter()
            self._finish(handle, state, f"{op} of {len(local_ids)} blocks", timeout)
            end = time.perf_counter()
            telemetry = self.agent.get_xfer_telemetry(handle)
        finally:
            _release(handle)
        return {"seconds": end - start, "make_seconds": made - start,
                "post_seconds": posted - made, "num_descs": telemetry.descCount,
                "nbytes": telemetry.totalBytes}

    def _finish(self, handle: Any, state: str, what: str, timeout: float) -> None:
        """Polls ``handle`` until done; raises ``BenchError`` naming ``what`` if it failed or
        outlived ``timeout``."""
        deadline = time.monotonic() + timeout
        while state == "PROC" and time.monotonic() < deadline:
            state = self.agent.check_xfer_state(handle)
        if state == "PROC":
            raise BenchError(f"NIXL {what} with {self.remote!r} not done within {timeout:g} s")
        if state != "DONE":
            raise BenchError(f"NIXL {what} with {self.remote!r} failed (NIXL reports "
                             f"{state!r}; NIXL_LOG_LEVEL=DEBUG for its reason)")

    def wait_notification(self, timeout: float) -> bytes:
        """The next notification from the other side (polled: NIXL has no blocking wait)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            notes = self.agent.get_new_notifs().get(self.remote)
            if notes:
                if len(notes) > 1:
                    raise BenchError(f"expected one notification from {self.remote!r}, got "
                                     f"{len(notes)}: {notes[:3]}")
                return bytes(notes[0])
        raise BenchError(f"no NIXL notification from {self.remote!r} within {timeout:g} s")

    def check_after_notification(self, tag: bytes, ids: list[int], src_ids: list[int],
                                 seed: int, timeout: float) -> int:
        """Waits for the notification ``tag``, then counts ``mismatches``."""
        expect_notification("NIXL", tag, self.wait_notification(timeout))
        return self.mismatches(ids, src_ids, seed)

    def wait_for(self, tag: bytes, timeout: float) -> None:
        """Polls (and so progresses this side's transfers) until the notification ``tag``."""
        expect_notification("NIXL", tag, self.wait_notification(timeout))

    def notify(self, payload: bytes) -> None:
        """A notification to the other side, outside any transfer."""
        self.agent.send_notif(self.remote, payload)

    def _one_block(self, local_id: int, remote_id: int, notify: bytes) -> Any:
        """A prepared request writing block ``local_id`` of layer 0 to ``remote_id``."""
        layer0 = range(1)
        return self.agent.make_prepped_xfer("WRITE", self._local,
                                            self._indices([local_id], layer0), self._remote,
                                            self._indices([remote_id], layer0), notify)

    def echo(self, local_id: int, remote_id: int, timeout: float) -> int:
        """Answers each notification with a one-block write of layer 0 and a notification
        (one prepared request, posted again each time), until the payload is the stop
        message; returns how many it answered."""
        handle, answered = self._one_block(local_id, remote_id, b"pong"), 0
        try:
            while self.wait_notification(timeout) != _STOP:
                self._post(handle, timeout)
                answered += 1
            return answered
        finally:
            _release(handle)

    def ping(self, local_id: int, remote_id: int, count: int, timeout: float) -> list[float]:
        """``count`` round trips with a side running ``echo``: each posts the prepared
        one-block write with a notification, polls it done and waits for the answer; returns
        each round trip's seconds, then stops the echo."""
        handle, seconds = self._one_block(local_id, remote_id, b"ping"), []
        try:
            for _ in range(count):
                start = time.perf_counter()
                self._post(handle, timeout)
                self.wait_notification(timeout)
                seconds.append(time.perf_counter() - start)
        finally:
            _release(handle)
        self.agent.send_notif(self.remote, _STOP)
        return seconds

    def _post(self, handle: Any, timeout: float) -> None:
        """Posts ``handle`` and polls it done. The polling is not optional: NIXL's UCX
        backend sends a request's notification from the status check that finds its data
        delivered, so a side that posts and then only waits for the answer waits forever."""
        self._finish(handle, self.agent.transfer(handle), "one-block write", timeout)

    def close(self) -> None:
        for prepared in (self._local, self._remote):
            if prepared is not None:
                prepared.release()
        self.agent.deregister_memory(self._registered)


def _release(handle: Any) -> None:
    """Frees a request; one still in flight (after a timeout) cannot be freed (NIXL raises)
    and is left to its agent, which frees it when it closes."""
    with contextlib.suppress(Exception):
        handle.release()


# The NixlSide's verbs a NixlPeer runs on command (``setup`` first).
_SIDE_VERBS = ("metadata", "connect", "place", "fill", "wipe", "mismatches", "transfer",
               "check_after_notification", "wait_for", "notify", "echo", "ping")


class NixlHost(SideHost):
    """What a NIXL process hosts: NIXL imported (``version`` says which), then per ``setup``
    a fresh ``NixlSide`` (closing the last one) whose verbs run on command.

    Args:
        transports: ``UCX_TLS`` for NIXL's UCX (None: UCX's choice), as kvmove's agents got.
        ucx_env: the UCX settings kvmove's agents add (``perftest.agent_ucx_env``), given to
            NIXL's UCX too: NIXL at its best, not at UCX's defaults (its tcp reads are 4-6x
            faster with them).
    """

    verbs = _SIDE_VERBS
    side_kind = "NixlSide"

    def __init__(self, transports: str | None, ucx_env: dict[str, str]) -> None:
        super().__init__()
        # NIXL's Python logger writes to stdout, which this process shares with the report:
        # everything this process prints goes to stderr instead.
        os.dup2(2, 1)
        os.environ.update(ucx_env)
        if transports:
            os.environ["UCX_TLS"] = transports
        self.api = import_nixl_api()
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)

    def version(self) -> str:
        return _version(self.api)

    def setup(self, name: str, layout: KVSpec, num_blocks: int, error_mode: str,
              strided: bool = False) -> None:
        self._replace(lambda: NixlSide(self.api, name, layout, num_blocks, error_mode, strided))

    def prep_seconds(self) -> float:
        assert self.side is not None
        return float(self.side.prep_seconds)


class NixlPeer(Child):
    """A process hosting a ``NixlHost`` (``harness.Child``: every reply has a deadline).

    Raises:
        ChildError: NIXL did not import there (``kind`` "ImportError", ``message`` why),
            or the process failed to start.
    """

    def __init__(self, name: str, transports: str | None, timeout: float) -> None:
        super().__init__(NixlHost, transports, agent_ucx_env(peer_errors=False), name=name,
                         label=f"NIXL process {name!r}",
                         timeout=timeout, idle_exit=_IDLE_SECONDS)
