"""kvmove: KV-cache transfer and storage for disaggregated LLM serving.

Start with ``KVSpec`` (the shape of a model's KV cache), ``KVCache`` (blocks of it in
memory) and ``BlockPool`` (which blocks a request owns); ``Agent`` moves blocks between
processes, ``KVStore`` keeps them in host and disk tiers.
"""

from __future__ import annotations

import libucx

from kvmove import errors

# UCX's libraries live in the libucx wheel. Loading them first lets kvmove._C resolve them by
# soname even when the extension's rpath does not point there (editable installs, UCX_HOME).
libucx.load_library()


def _missing_core() -> ImportError:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return ImportError(
        f"kvmove's compiled core (kvmove._C) is not built in {here}: this looks like a source "
        "checkout imported instead of the installed package. Install it (`pip install .`) and "
        "run from outside the checkout (plain `pytest` does; `python -m pytest` puts the "
        "current directory first on sys.path), or build it in place for development "
        "(`python setup.py build_ext --inplace`).")


try:
    # Unused here: imported first so that a missing core fails with _missing_core's advice.
    from kvmove import _C  # noqa: E402, F401
except ImportError as error:
    import importlib.util

    if importlib.util.find_spec("kvmove._C") is None:
        raise _missing_core() from error
    raise
from kvmove.runtime import check_ucx  # noqa: E402

check_ucx()  # the UCX loaded is one kvmove runs on, or ImportError naming it and its path

from kvmove import _log  # noqa: E402
from kvmove._version import __version__ as __version__  # noqa: E402 (re-exported)
from kvmove.agent import Agent, AgentStats  # noqa: E402
from kvmove.block_pool import BlockPool, block_hashes, runs  # noqa: E402
from kvmove.kv_cache import KVCache  # noqa: E402
from kvmove.kv_spec import KVLayout as KVLayout  # noqa: E402  (the old name of KVSpec)
from kvmove.kv_spec import KVSpec  # noqa: E402
from kvmove.region import Region  # noqa: E402
from kvmove.runtime import (  # noqa: E402
    CudaStatus,
    UcxInfo,
    cuda_available,
    cuda_status,
    ucx_info,
    ucx_version,
)
from kvmove.staging import StagedLoad, StagedWrite, StagingArea  # noqa: E402
from kvmove.store import DiskTier, HostTier, KVStore, Lookup, StoreHandle  # noqa: E402
from kvmove.stream import LoadStream, Offer, SaveStream, StreamState  # noqa: E402
from kvmove.transfer import (  # noqa: E402
    TRAFFIC_CLASSES,
    Transfer,
    TransferState,
    TransferStats,
)

_log.start()  # the core's log records reach Python's logging (KVMOVE_LOG_LEVEL)

__all__ = [
    "TRAFFIC_CLASSES",
    "Agent",
    "AgentStats",
    "BlockPool",
    "CudaStatus",
    "DiskTier",
    "HostTier",
    "KVCache",
    "KVSpec",
    "KVStore",
    "Lookup",
    "LoadStream",
    "Offer",
    "Region",
    "SaveStream",
    "StagedLoad",
    "StagedWrite",
    "StagingArea",
    "StoreHandle",
    "StreamState",
    "Transfer",
    "TransferState",
    "TransferStats",
    "UcxInfo",
    "block_hashes",
    "cuda_available",
    "cuda_status",
    "errors",
    "runs",
    "ucx_info",
    "ucx_version",
]
