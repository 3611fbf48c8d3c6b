"""kvmove's ``KVStore`` as an SGLang HiCache storage backend (the L3 tier below SGLang's host
pool), loaded through SGLang's ``dynamic`` backend (docs/sglang.md):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvmove",
        "module_path": "kvmove.integrations.sglang", "class_name": "KVMoveHiCacheStorage",
        "interface_v1": 1, "host_bytes": 8589934592}'

SGLang moves a page between its GPU cache and its host pool itself; this backend moves pages
between the host pool and a ``KVStore`` (host tier, optional disk tier). The host pool is
wrapped once (``register_mem_pool_host``, ``kvmove/integrations/sglang_pool.py``), so
``batch_set_v1`` / ``batch_get_v1`` are ``store.put`` / ``store.get`` of page ids: no tensor per
page, no copy through Python.

Keys: SGLang names a page by a string (a hex SHA-256 chained over the prefix). kvmove's store
keys blocks by 64-bit integers; ``key_hash`` takes the first 8 bytes of BLAKE2b over the key's
UTF-8 bytes: deterministic across processes and restarts (unlike ``hash()``), so a disk tier
written by one server serves the next. Two keys collide with probability about
``n**2 / 2**65`` (1e-8 for 1e6 stored pages). The store's checksums (seeded with the hash)
catch torn or corrupted bytes, not a collision.

This module imports SGLang (it subclasses ``HiCacheStorage``); ``import kvmove`` never imports
it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch

# SGLang ships no py.typed, and is absent where CI runs mypy: both ways its names are Any.
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from kvmove.errors import ConfigError
from kvmove.errors import TimeoutError as KVMoveTimeout
from kvmove.integrations.sglang_pool import WrappedPool, page_ids, wrap_host_pool
from kvmove.store import DiskTier, HostTier, KVStore, StoreHandle

__all__ = ["KVMoveHiCacheStorage", "StoreConfig", "key_hash"]

logger = logging.getLogger(__name__)

# SGLang's own keys in the same dict (the dynamic loader's and the controller's).
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
_OUR_KEYS = {"host_bytes", "disk_dir", "disk_bytes", "disk_direct", "namespace", "io_timeout"}
_WAIT_S = 30.0  # between warnings while a put/get is still running (until io_timeout)
_V1_ONLY = ("kvmove's SGLang backend implements the zero-copy v1 interface only "
            "(batch_get_v1 / batch_set_v1): set \"interface_v1\": 1 in "
            "--hicache-storage-backend-extra-config")


def key_hash(key: str) -> int:
    """SGLang's page key as the store's block hash: BLAKE2b's first 8 bytes, big-endian."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The store's part of ``--hicache-storage-backend-extra-config``.

    Args:
        host_bytes: host memory for stored pages (rounded down to whole pages).
        disk_dir: a directory for a disk tier below the host tier; each rank opens its own
            folder inside it (``rank_folder``).
        disk_bytes: the disk tier's capacity (required with ``disk_dir``).
        disk_direct: O_DIRECT reads and writes (``DiskTier.direct``).
        namespace: what else makes equal tokens give equal KV beyond SGLang's model name
            (e.g. a checkpoint revision); stored with the disk tier.
        io_timeout: seconds a put or get may take; past it the call raises
            ``kvmove.errors.TimeoutError`` rather than return while the store may still
            copy into (or out of) host pages SGLang reuses once it returns.
    """

    host_bytes: int | None = None
    disk_dir: str | None = None
    disk_bytes: int | None = None
    disk_direct: bool = True
    namespace: str = ""
    io_timeout: float = 60.0

    def __post_init__(self) -> None:
        for key in ("host_bytes", "disk_bytes"):
            value = getattr(self, key)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"extra_config[{key!r}] must be a positive integer number "
                                  f"of bytes, got {value!r}")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str)
                                          or not self.disk_dir):
            raise ConfigError(f"extra_config['disk_dir'] must be a non-empty path, got "
                              f"{self.disk_dir!r}")
        if (self.disk_dir is None) != (self.disk_bytes is None):
            raise ConfigError(f"extra_config['disk_dir'] and ['disk_bytes'] go together, got "
                              f"disk_dir={self.disk_dir!r}, disk_bytes={self.disk_bytes!r}")
        if self.host_bytes is None and self.disk_dir is None:
            raise ConfigError("extra_config needs 'host_bytes' and/or 'disk_dir' with "
                              "'disk_bytes': the store has no tier")
        if not isinstance(self.disk_direct, bool):
            raise ConfigError(f"extra_config['disk_direct'] must be true or false, got "
                              f"{self.disk_direct!r}")
        if isinstance(self.io_timeout, bool) or not isinstance(self.io_timeout, (int, float)) \
                or not math.isfinite(self.io_timeout) or self.io_timeout <= 0:
            raise ConfigError(f"extra_config['io_timeout'] must be a positive number of "
                              f"seconds, got {self.io_timeout!r}")
        if not isinstance(self.namespace, str):
            raise ConfigError(f"extra_config['namespace'] must be a string, got "
                              f"{self.namespace!r}")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> StoreConfig:
        """Raises ``ConfigError`` without ``interface_v1`` or for a bad value (naming it);
        logs keys neither kvmove's nor SGLang's (a misspelt size is then reported missing)."""
        if not isinstance(extra, dict):
            raise ConfigError(f"--hicache-storage-backend-extra-config must be a JSON object, "
                              f"got {extra!r}")
        if not extra.get("interface_v1"):
            raise ConfigError(_V1_ONLY)
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS)
        if unknown:
            logger.warning("extra_config keys %s are not kvmove's (%s): ignored", unknown,
                           ", ".join(sorted(_OUR_KEYS)))
        return cls(**{k: extra[k] for k in _OUR_KEYS if k in extra})


def rank_folder(config: HiCacheStorageConfig) -> str:
    """This rank's name among SGLang's parallel ranks: its folder in ``disk_dir`` and part of
    the store's namespace (each rank stores its own shard of the KV)."""
    return (f"tp{config.tp_rank}-{config.tp_size}_pp{config.pp_rank}-{config.pp_size}"
            f"_dp{config.dp_rank}_cp{config.attn_cp_rank}-{config.attn_cp_size}")


class KVMoveHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a ``kvmove.KVStore``.

    SGLang's factory calls ``KVMoveHiCacheStorage(storage_config, kwargs)``, then its
    controller ``register_mem_pool_host(host_pool)``; the store opens there, when the page's
    shape is known.

    Back-pressure, never an exception: a page the full store cannot take is reported not
    stored (``False``); the store makes room by evicting its least recently used pages (to
    the disk tier, then out). A page that reads back corrupt is a miss, dropped, never served.

    Raises:
        ConfigError: a bad extra_config (naming the key), or a deployment one store per
            process cannot serve (MLA with tp_size > 1, decode context parallelism, heads
            split across heterogeneous TP).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = StoreConfig.from_extra_config(storage_config.extra_config)
        # SGLang writes an MLA (rank-replicated) page from one rank only and reads it on
        # every rank; kvmove's store lives in each rank's process, so the others would
        # never hit (and the hit count is reduced with MIN over the ranks).
        if storage_config.is_mla_model and storage_config.tp_size > 1:
            raise ConfigError(f"an MLA model with tp_size {storage_config.tp_size}: SGLang "
                              "stores its pages from rank 0 only, and kvmove's store is per "
                              "process; use tp_size 1 or a shared backend")
        if storage_config.dcp_size > 1 or storage_config.should_split_heads:
            raise ConfigError("kvmove's SGLang backend does not serve decode context "
                              "parallelism (dcp_size > 1) or heads split across TP sizes "
                              "(tp_lcm_size)")
        self.storage_config = storage_config
        self.store: KVStore | None = None
        self.wrapped: WrappedPool | None = None
        self._page_size = 0

    # --- setup ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Wraps SGLang's host pool and opens the store (``ConfigError`` for a pool or a
        capacity it cannot use)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            self.store.close()
        self.wrapped = wrap_host_pool(mem_pool_host)
        self._page_size = int(mem_pool_host.page_size)
        self.store = self._open_store()

    def _open_store(self) -> KVStore:
        assert self.wrapped is not None
        spec, cfg = self.wrapped.spec, self.config
        tiers: list[HostTier | DiskTier] = []
        for key, size in (("host_bytes", cfg.host_bytes), ("disk_bytes", cfg.disk_bytes)):
            if size is not None and size < spec.bytes_per_block:
                raise ConfigError(f"extra_config[{key!r}] = {size} holds no page: one page "
                                  f"is {spec.bytes_per_block} B")
        if cfg.host_bytes is not None:
            tiers.append(HostTier(cfg.host_bytes))
        if cfg.disk_dir is not None and cfg.disk_bytes is not None:
            path = os.path.join(cfg.disk_dir, rank_folder(self.storage_config))
            tiers.append(DiskTier(path, cfg.disk_bytes, direct=cfg.disk_direct))
        namespace = "/".join(["sglang", self.storage_config.model_name or "", cfg.namespace,
                              self.wrapped.layout_tag, rank_folder(self.storage_config)])
        # "always": the store reports what it holds; SGLang decides what to prefetch.
        return KVStore(spec, tiers, namespace=namespace, load_policy="always",
                       order=self.wrapped.order)

    def _ready(self) -> tuple[KVStore, WrappedPool]:
        if self.store is None or self.wrapped is None:
            raise ConfigError("register_mem_pool_host(host_pool) must come before any "
                              "transfer: the store opens with the pool's page shape")
        return self.store, self.wrapped

    # --- the v1 interface: pages between SGLang's host pool and the store --------------------

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Stores the pages at ``host_indices`` (``len(keys) * page_size`` token indices)
        under ``keys``; per key, whether the store holds it afterwards."""
        store, wrapped = self._ready()
        if not keys:
            return []
        pages = page_ids(host_indices, len(keys), self._page_size)
        hashes = [key_hash(k) for k in keys]
        _wait(store.put(hashes, wrapped.cache, pages), "put", len(keys),
              self.config.io_timeout)
        # Per page: a full store keeps the leading pages it can (back-pressure, not an error).
        # Asked one lookup each, which the store's counters include.
        return [store.lookup([h]).num_blocks == 1 for h in hashes]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Loads the stored pages ``keys`` into ``host_indices``, stopping at the first one
        missing or corrupt: ``True`` for the leading pages that arrived intact."""
        store, wrapped = self._ready()
        if not keys:
            return []
        pages = page_ids(host_indices, len(keys), self._page_size)
        done = _wait(store.get([key_hash(k) for k in keys], wrapped.cache, pages), "get",
                     len(keys), self.config.io_timeout)
        return [i < done for i in range(len(keys))]

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` the store holds (a hit makes them recently used)."""
        store, _ = self._ready()
        return store.lookup([key_hash(k) for k in keys]).num_blocks

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- the per-page tensor interface SGLang calls without interface_v1 ----------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise ConfigError(_V1_ONLY)

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> Any:
        raise ConfigError(_V1_ONLY)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        raise ConfigError(_V1_ONLY)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise ConfigError(_V1_ONLY)

    # --- life cycle -------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drops every stored page (SGLang's ``/flush_cache``): the store is closed, this
        rank's disk folder removed, and an empty store opened."""
        if self.store is None:
            return True
        self.store.close()
        self.store = None
        if self.config.disk_dir is not None:
            shutil.rmtree(os.path.join(self.config.disk_dir, rank_folder(self.storage_config)),
                          ignore_errors=True)
        self.store = self._open_store()
        logger.info("cleared kvmove's HiCache store")
        return True

    def get_stats(self) -> dict[str, Any] | None:
        """The store's counters (``KVStore.stats``) as a dict, None before the pool."""
        return None if self.store is None else self.store.stats().as_dict()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _wait(handle: StoreHandle, what: str, num_pages: int, timeout: float) -> int:
    """Waits for a put or get to finish, up to ``timeout`` seconds (a warning every
    ``_WAIT_S``). SGLang reuses the host pages once the call returns, so it never returns
    while the store may still copy into (or out of) them: past the deadline it raises, and
    the request fails rather than compute on pages another request's KV may overwrite."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return handle.wait(max(0.001, min(_WAIT_S, deadline - time.monotonic())))
        except KVMoveTimeout:
            if time.monotonic() >= deadline:
                raise KVMoveTimeout(f"kvmove store {what} of {num_pages} pages took over "
                                    f"io_timeout = {timeout:g} s; failing rather than let "
                                    "SGLang reuse host pages the store may still copy") \
                    from None
            logger.warning("kvmove store %s of %d pages still running after %g s", what,
                           num_pages, _WAIT_S)
