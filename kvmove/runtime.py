"""What this process runs on: the UCX library loaded, the CUDA devices usable, and the CPUs
kvmove's threads may run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from kvmove import _C

__all__ = ["CudaStatus", "cuda_available", "cuda_status", "ucx_version", "unpin", "unpinned"]


@dataclass(frozen=True, slots=True)
class CudaStatus:
    """Whether CUDA can be used here, and why not.

    Attributes:
        built: kvmove was compiled with ``KVMOVE_CUDA=1``.
        device_count: devices the driver reports (0 when not built or no driver).
        reason: why ``device_count`` is 0; empty when devices are usable.

    Example:
        >>> status = kvmove.cuda_status()      # a CPU-only build
        >>> status.built, status.device_count, status.reason
        (False, 0, 'kvmove was built without CUDA (rebuild with KVMOVE_CUDA=1)')
    """

    built: bool
    device_count: int
    reason: str


def cuda_status() -> CudaStatus:
    """Asks the compiled core (and the driver, when built with CUDA); never raises.

    Example:
        >>> status = kvmove.cuda_status()
        >>> status.device_count or status.reason    # devices, or why there are none
    """
    return CudaStatus(*_C.cuda_status())


def cuda_available() -> bool:
    """True when kvmove was built with CUDA and at least one device is usable.

    Example:
        >>> device = "cuda:0" if kvmove.cuda_available() else "cpu"
        >>> cache = kvmove.KVCache(layout, num_blocks=1024, device=device)
    """
    return cuda_status().device_count > 0


def ucx_version() -> str:
    """Version of the UCX library this process loaded.

    Example:
        >>> kvmove.ucx_version()
        '1.22.0'
    """
    return _C.ucx_version()


def unpin() -> None:
    """Lets the calling thread run on every CPU this process may use (the kernel clips the
    set to its cpuset); a thread pool's initializer."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside run on every CPU this process may use, not only on the CPUs the
    calling thread is pinned to; the calling thread's pin is restored on the way out.

    A thread inherits its creator's affinity. An engine pins its model thread (vLLM's CPU
    backend to one core, OpenMP thread 0; ``kvmove-serve`` a worker to its share of the
    cores), and without this kvmove's progress, copy and listener threads, and ZeroMQ's I/O
    threads, all share those cores with a model thread that steps without pause while a
    request waits for its KV (seen: two instances on 2 cores, every kvmove thread of both on
    core 0; a ``kvmove-serve`` decode worker learning of its KV only when its compute thread
    gave the core up).

    Example:
        >>> os.sched_setaffinity(0, {0})          # the model's core
        >>> with kvmove.runtime.unpinned():
        ...     agent = kvmove.Agent("decode-0", cache)   # its threads: every CPU
    """
    pinned = os.sched_getaffinity(0)
    unpin()
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
