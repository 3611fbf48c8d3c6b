"""What this process runs on: the UCX library loaded and the CUDA devices usable."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove import _C

__all__ = ["CudaStatus", "cuda_available", "cuda_status", "ucx_version"]


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
