"""Region: host or device memory with one owner — the bytes behind a ``KVCache``.

Host memory is an anonymous mapping (page-aligned, zero-filled, optionally huge pages and
page-locked); device memory is one ``cudaMalloc`` (``csrc/memory/region.h``). Python sees the
bytes zero-copy through the array interfaces: ``numpy.asarray(region)`` (host) is a writable
``[nbytes]`` uint8 view, and torch, CuPy or Numba take a device region through
``__cuda_array_interface__``.
"""

from __future__ import annotations

from typing import Any

from kvmove import _C

__all__ = ["Region"]


class Region:
    """``nbytes`` of host memory, or of CUDA device ``device``'s.

    Args:
        nbytes: the size, > 0.
        huge_pages: align to 2 MiB and ask for transparent huge pages (host).
        device: -1 for host memory, else the CUDA device (needs a CUDA build).
        pin: page-lock host memory for DMA (cudaHostRegister), where a GPU is usable.

    Example:
        >>> region = kvmove.Region(64 << 20, huge_pages=True)   # 64 MiB of host memory
        >>> view = numpy.asarray(region)       # [67108864] uint8, no copy
        >>> region.addr % (2 << 20), region.device
        (0, -1)
    """

    __slots__ = ("_core", "_owner")

    def __init__(self, nbytes: int, *, huge_pages: bool = False, device: int = -1,
                 pin: bool = False) -> None:
        self._core = _C.Region(nbytes, huge_pages, device, pin)
        self._owner: Any = None

    @classmethod
    def _of(cls, core: _C.Region, owner: Any) -> Region:
        """The region of a core ``KVCache``, keeping ``owner`` (its cache) alive."""
        region = cls.__new__(cls)
        region._core, region._owner = core, owner
        return region

    @property
    def addr(self) -> int:
        return self._core.addr

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    @property
    def huge_pages(self) -> bool:
        return self._core.huge_pages

    @property
    def device(self) -> int:
        """The CUDA device, or -1 for host memory."""
        return self._core.device

    @property
    def pinned(self) -> bool:
        """Host memory page-locked for DMA (cudaHostRegister)."""
        return self._core.pinned

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """Host memory as a writable ``[nbytes]`` uint8 array (numpy's array interface v3).
        AttributeError for device memory, as the interface expects."""
        if self.device >= 0:
            raise AttributeError(f"a region on cuda:{self.device} has no __array_interface__: "
                                 "use __cuda_array_interface__")
        return {"shape": (self.nbytes,), "typestr": "|u1", "version": 3,
                "data": (self.addr, False), "strides": None}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Device memory as ``[nbytes]`` uint8 (CUDA Array Interface v3); no stream to wait on
        (kvmove's device calls return synchronized). AttributeError for host memory."""
        if self.device < 0:
            raise AttributeError("a host region has no __cuda_array_interface__: use "
                                 "numpy.asarray(region)")
        return {"shape": (self.nbytes,), "typestr": "|u1", "version": 3,
                "data": (self.addr, False), "strides": None, "stream": None}

    def __repr__(self) -> str:
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"Region(addr=0x{self.addr:x}, nbytes={self.nbytes}, {where})"
