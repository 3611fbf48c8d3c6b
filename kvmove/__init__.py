"""kvmove: KV-cache transfer and storage for disaggregated LLM serving.

Start with ``KVLayout`` (the shape of a model's KV cache), ``KVCache`` (blocks of it in
memory) and ``BlockPool`` (which blocks a request owns); ``Agent`` moves blocks between
processes, ``KVStore`` keeps them in host and disk tiers.
"""

from __future__ import annotations

import libucx

from kvmove import errors

# UCX's libraries live in the libucx wheel. Loading them first lets kvmove._C resolve them by
# soname even when the extension's rpath does not point there (editable installs, UCX_HOME).
libucx.load_library()

from kvmove import _C  # noqa: E402
from kvmove._C import BlockPool, Region, block_hashes, runs  # noqa: E402
from kvmove.agent import Agent, Transfer, TransferState, TransferStats  # noqa: E402
from kvmove.kv_cache import KVCache  # noqa: E402
from kvmove.layout import KVLayout  # noqa: E402
from kvmove.store import DiskTier, HostTier, KVStore, Lookup, StoreHandle  # noqa: E402
from kvmove.stream import LoadStream, SaveStream, StreamState  # noqa: E402
from kvmove.runtime import CudaStatus, cuda_available, cuda_status, ucx_version  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "BlockPool",
    "CudaStatus",
    "DiskTier",
    "HostTier",
    "KVCache",
    "KVLayout",
    "KVStore",
    "Lookup",
    "LoadStream",
    "Region",
    "SaveStream",
    "StoreHandle",
    "StreamState",
    "Transfer",
    "TransferState",
    "TransferStats",
    "block_hashes",
    "cuda_available",
    "cuda_status",
    "errors",
    "runs",
    "ucx_version",
]
