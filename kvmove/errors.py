"""kvmove's exception hierarchy, mirrored by ``csrc/common/errors.h``.

Every error names what failed, the offending value and the limit, e.g.
``ConfigError("cannot allocate 2000 blocks: the pool has 1024")``. Errors raised in C++ arrive
here as the class of the same name (one translator in ``bindings/module.cpp``).

Running out of room *right now* is not an error: ``BlockPool.allocate`` returns ``None``.

Example:
    >>> try:
    ...     transfer.wait(timeout=5.0)
    ... except kvmove.errors.PeerError:       # the peer died: its transfers failed at once
    ...     reschedule(request)
    ... except kvmove.errors.KVMoveError as error:
    ...     log.error("hand-off failed: %s", error)   # names the value and the limit
"""

from __future__ import annotations

import builtins

__all__ = [
    "KVMoveError",
    "ConfigError",
    "BlockError",
    "AllocationError",
    "OutOfBlocksError",
    "TransferError",
    "ChecksumError",
    "PeerError",
    "MetadataError",
    "TimeoutError",
    "UCXError",
    "CudaError",
    "StoreError",
]


class KVMoveError(Exception):
    """Base class of every error kvmove raises."""


class ConfigError(KVMoveError, ValueError):
    """A parameter is out of its allowed range or inconsistent with another."""


class BlockError(KVMoveError, ValueError):
    """A block id is out of range, or its block is not in the state the call needs
    (freeing a free block, sharing a free block, committing a block nobody owns)."""


class AllocationError(KVMoveError, MemoryError):
    """The operating system (or the CUDA driver) refused memory kvmove asked for."""


class OutOfBlocksError(KVMoveError):
    """Blocks were required (not merely requested) and none can be had."""


class TransferError(KVMoveError):
    """A transfer failed: its blocks were not all delivered."""


class ChecksumError(TransferError):
    """Received KV does not match the checksums its sender computed: it was corrupted on the
    way (or overwritten) and must not be used. The load names the bad blocks
    (``LoadStream.bad_blocks()``)."""


class PeerError(KVMoveError):
    """A peer is unknown, unreachable, dead, or sent malformed metadata."""


class MetadataError(PeerError, ValueError):
    """Peer metadata is truncated, forged, or of an unknown format version."""


class TimeoutError(KVMoveError, builtins.TimeoutError):
    """A wait passed its deadline."""


class UCXError(KVMoveError):
    """A UCX call failed; the message carries UCX's status string."""


class CudaError(KVMoveError):
    """A CUDA call failed, or CUDA is not available in this build or on this machine."""


class StoreError(KVMoveError):
    """A storage tier cannot be used: its directory or files are unreadable, in use by another
    process, or were written for another KV layout. (I/O failures while a store runs, a full
    disk included, are not raised: the blocks are reported as not stored, or as misses.)"""
