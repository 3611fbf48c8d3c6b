"""What this process runs on: the UCX library loaded, the CUDA devices usable, and the CPUs
kvmove's threads may run on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmove import _C

__all__ = ["CudaStatus", "UcxInfo", "cuda_available", "cuda_status", "ucx_info", "ucx_version",
           "unpin", "unpinned"]

# The oldest UCX kvmove builds and runs with (Debian 12's 1.13.1 has verbs and rdmacm; UCX
# before 1.14 cannot tell an endpoint's lanes, so Agent.peer_transports is then empty).
MIN_UCX = (1, 13)

# UCX's transport modules that carry InfiniBand/RoCE (verbs, its mlx5 flavours) and the RDMA
# connection manager; a UCX built without verbs/rdmacm (the libucx-cu13 wheel) has none.
RDMA_MODULES = ("ib", "ib_mlx5", "ib_efa", "rdmacm")


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


@dataclass(frozen=True, slots=True)
class UcxInfo:
    """The UCX this process loaded, and what it can use here.

    Attributes:
        version: of the libucp loaded, e.g. ``"1.22.0"``.
        library: the libucp file loaded ("" where the loader cannot tell).
        source: ``"libucx wheel"`` (the ``libucx-cu13`` package kvmove depends on) or
            ``"site"`` (a UCX of the host's: ``UCX_HOME`` at build time, or the loader's path).
        modules: the transport modules its build has (``libuct_<name>.so`` in its module
            folder): ``"cma"``, ``"cuda"``, ``"ib"``, ``"rdmacm"``...
        loaded: those of ``modules`` this process has loaded (UCX loads one when a context
            or this report asks for its resources; a module whose libraries are missing
            does not load).
        transports: ``"transport/device"`` for every resource UCX finds here
            (``"tcp/eth0"``, ``"posix/memory"``, ``"rc_mlx5/mlx5_0:1"``), as ``ucx_info -d``.
        rdma: InfiniBand/RoCE support is built into this UCX (its verbs or rdmacm modules).
        cuda: CUDA support is built into this UCX (its cuda module).
        gpudirect: what GPUDirect RDMA (a NIC reading and writing GPU memory) has here:
            ``"nvidia-peermem"`` (the kernel module that lets NICs register GPU memory is
            loaded), ``"dma-buf"`` (no peermem, but a kernel of 5.12 or later and NVIDIA's
            driver: UCX 1.14+ registers GPU memory as dma-buf where the driver supports it),
            or ``"none"`` (device memory then crosses hosts through host buffers).

    Example:
        >>> info = kvmove.ucx_info()
        >>> info.version, info.source, info.rdma, info.transports[:2]
        ('1.22.0', 'libucx wheel', False, ('cma/memory', 'posix/memory'))
    """

    version: str
    library: str
    source: str
    modules: tuple[str, ...]
    loaded: tuple[str, ...]
    transports: tuple[str, ...]
    rdma: bool
    cuda: bool
    gpudirect: str = "none"

    @property
    def rdma_devices(self) -> tuple[str, ...]:
        """Transport resources on RDMA devices (none without an HCA or without ``rdma``)."""
        return tuple(t for t in self.transports
                     if t.split("/")[0].startswith(("rc_", "ud_", "dc_", "srd")))

    def summary(self) -> str:
        """One line for a report's header: version, where from, transports, RDMA and CUDA."""
        where = self.source + (f" ({self.library})" if self.library else "")
        nets = sorted({t.split("/")[0] for t in self.transports})
        rdma = ("RDMA built in, " + (f"devices {', '.join(self.rdma_devices)}"
                                     if self.rdma_devices else "no RDMA device here")
                if self.rdma else "RDMA not built in (no verbs/rdmacm modules)")
        cuda = "CUDA built in" if self.cuda else "CUDA not built in"
        if self.cuda and self.rdma:
            cuda += f", GPUDirect RDMA: {self.gpudirect}"
        unloaded = [m for m in self.modules if m not in self.loaded]
        modules = ", ".join(self.modules) or "none"
        if unloaded:
            modules += f" ({', '.join(unloaded)} did not load here)"
        return (f"UCX {self.version} from the {where}: transports {', '.join(nets) or 'none'}; "
                f"modules {modules}; {rdma}; {cuda}")

    def to_dict(self) -> dict[str, Any]:
        fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {**fields, "rdma_devices": list(self.rdma_devices)}


def ucx_problem(loaded: str, built: str) -> str | None:
    """Why the UCX this process loaded cannot serve kvmove (older than ``MIN_UCX`` or than the
    UCX it was compiled against), or None."""
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())

    need = max(MIN_UCX, version(built))
    if version(loaded) >= need:
        return None
    return (f"kvmove needs UCX >= {'.'.join(map(str, need))} (the oldest it supports is "
            f"{'.'.join(map(str, MIN_UCX))}; it was compiled against {built}), but this process "
            f"loaded UCX {loaded}")


def check_ucx() -> None:
    """Raises ImportError, naming both versions and the library's path, when the loaded UCX is
    older than kvmove needs (``ucx_problem``): called when kvmove is imported."""
    problem = ucx_problem(_C.ucx_version(), _C.ucx_built_version())
    if problem is not None:
        raise ImportError(f"{problem} from {_C.ucx_library() or 'an unknown path'}: a site UCX "
                          "needs RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true, and one built "
                          "against is the one to load (README, 'Build options')")


def ucx_info() -> UcxInfo:
    """What UCX this process runs (asks UCX for its resources: loads its modules; about a
    millisecond, never raises for a module that cannot load).

    Example:
        >>> print(kvmove.ucx_info().summary())
        UCX 1.22.0 from the libucx wheel (...): transports cma, posix, self, sysv, tcp; ...
    """
    library = _C.ucx_library()
    resources = _C.ucx_resources()
    modules = _modules(library)
    loaded = _loaded_modules()
    return UcxInfo(
        version=_C.ucx_version(), library=library,
        source="libucx wheel" if _in_libucx_wheel(library) else "site",
        modules=modules, loaded=tuple(m for m in modules if m in loaded),
        transports=tuple(sorted({f"{tl}/{dev}" for _, _, tl, dev, _ in resources})),
        rdma=any(m in RDMA_MODULES for m in modules), cuda="cuda" in modules,
        gpudirect=gpudirect())


def gpudirect(sys_root: str = "/sys", kernel: str | None = None) -> str:
    """``UcxInfo.gpudirect``, from the kernel's modules (``sys_root``/module) and release."""
    modules = Path(sys_root) / "module"
    if (modules / "nvidia_peermem").exists() or (modules / "nv_peer_mem").exists():
        return "nvidia-peermem"
    release = kernel if kernel is not None else os.uname().release
    numbers = tuple(int(p) for p in release.split("-")[0].split(".")[:2] if p.isdigit())
    if (modules / "nvidia").exists() and numbers >= (5, 12):
        return "dma-buf"
    return "none"


def _modules(library: str) -> tuple[str, ...]:
    """The ``libuct_<name>.so`` beside a UCX library (its ``ucx/`` module folder)."""
    folder = Path(library).parent / "ucx" if library else None
    if folder is None or not folder.is_dir():
        return ()
    return tuple(sorted(p.name[len("libuct_"):-len(".so")] for p in folder.glob("libuct_*.so")))


def _loaded_modules() -> set[str]:
    """The UCX transport modules mapped into this process (``/proc/self/maps``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = (line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/libuct_" in line)
    return {name[len("libuct_"):].split(".so")[0] for name in names}


def _in_libucx_wheel(library: str) -> bool:
    try:
        import libucx
    except ImportError:
        return False
    wheel = Path(libucx.__file__).resolve().parent
    return bool(library) and Path(library).resolve().is_relative_to(wheel)


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
