"""kvmove's ``KVStore`` as LMCache's storage (LMCache 0.5.6; docs/lmcache.md).

Two plugins, one for each of LMCache's storage layers, both keeping LMCache's objects in a
``ChunkStore`` (``kvmove/integrations/chunk_store.py``: host and/or disk tiers, LRU,
a checksum per block):

- ``KVMoveL2Adapter``: an L2 adapter of LMCache's multiprocess cache server (``lmcache
  server``, ``lmcache bench l2``), loaded as
  ``{"type": "plugin", "module_path": "kvmove.integrations.lmcache",
  "class_name": "KVMoveL2Adapter", "adapter_params": {...}}``.
- ``KVMoveConnectorAdapter``: a remote-storage plugin of the in-process engine (the v1
  ``StorageManager`` that vLLM's ``LMCacheConnectorV1`` runs), loaded with
  ``remote_storage_plugins: ["kvmove"]`` and
  ``extra_config: {remote_storage_plugin.kvmove.module_path: kvmove.integrations.lmcache,
  remote_storage_plugin.kvmove.class_name: KVMoveConnectorAdapter}``.

Only LMCache imports this module; ``import kvmove`` never imports LMCache.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# LMCache ships no type information; mypy sees its names as Any.
from lmcache.lmcache_native import Bitmap  # type: ignore[import-not-found, import-untyped, unused-ignore]
from lmcache.logging import init_logger  # type: ignore[import-not-found, import-untyped, unused-ignore]
from lmcache.v1.distributed.internal_api import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    L2StoreResult,
)
from lmcache.v1.distributed.l2_adapters.base import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    L2AdapterInterface,
)
from lmcache.v1.distributed.l2_adapters.config import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    L2AdapterConfigBase,
)
from lmcache.v1.platform import create_event_notifier  # type: ignore[import-not-found, import-untyped, unused-ignore]
from lmcache.v1.protocol import RemoteMetadata  # type: ignore[import-not-found, import-untyped, unused-ignore]
from lmcache.v1.storage_backend.connector import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
    RemoteConnector,
)

from kvmove.errors import ConfigError
from kvmove.integrations.chunk_store import ChunkStore, ChunkStoreConfig

__all__ = ["KVMoveConnector", "KVMoveConnectorAdapter", "KVMoveL2Adapter",
           "KVMoveL2AdapterConfig", "object_key_string"]

logger = init_logger(__name__)

PLUGIN_TYPE = "kvmove"  # remote_storage_plugins entries "kvmove" or "kvmove.<instance>"
_SETTINGS = ("host_gb", "disk_path", "disk_gb", "staging_chunks")


def object_key_string(key: Any) -> str:
    """An ``ObjectKey``'s canonical spelling (every field; ``@`` cannot occur in a model name
    or a salt, so the spelling is unambiguous)."""
    return (f"{key.chunk_hash.hex()}@{key.model_name}@{key.kv_rank}@{key.object_group_id}"
            f"@{key.cache_salt}")


def _as_bytes(memory_obj: Any) -> np.ndarray:
    """An LMCache ``MemoryObj``'s bytes (its logical size), zero-copy: uint8, 1-D."""
    return np.frombuffer(memory_obj.byte_array, dtype=np.uint8)


# --- the L2 adapter (multiprocess cache server, `lmcache bench l2`) ------------------------


class KVMoveL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc, unused-ignore]
    """``adapter_params`` of the plugin: ``host_gb`` (default 1; 0: no host tier),
    ``disk_path`` and ``disk_gb`` (a disk tier, optional), ``chunk_bytes`` (the largest
    object stored; default: the first object's size, the store then opens on the first
    store; set it to find a disk tier's chunks after a restart before storing anything),
    ``staging_chunks`` (objects copied per store operation, default 64), ``namespace``."""

    def __init__(self, store: ChunkStoreConfig, chunk_bytes: int | None,
                 namespace: str) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.namespace = namespace

    @classmethod
    def from_dict(cls, d: dict) -> KVMoveL2AdapterConfig:
        """Raises ConfigError (a ValueError, as LMCache expects) naming the key and value."""
        known = {*_SETTINGS, "chunk_bytes", "namespace", "type"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown kvmove L2 adapter parameter(s) {unknown}; known: "
                              f"{sorted(known - {'type'})}")
        store = ChunkStoreConfig.from_gb(d, _SETTINGS)
        chunk = d.get("chunk_bytes")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ConfigError(f"chunk_bytes must be a positive integer, got {chunk!r}")
        return cls(store, chunk, str(d.get("namespace", "lmcache")))

    @classmethod
    def help(cls) -> str:
        return str(cls.__doc__)


class KVMoveL2Adapter(L2AdapterInterface):  # type: ignore[misc, unused-ignore]
    """LMCache L2 adapter over a ``ChunkStore``. Every task runs in order on one thread of
    its own and signals its event fd when done.

    Keys are not locked between lookup and load: the store may evict a key meanwhile, and
    its load then fails (LMCache treats a failed load as a miss). ``delete`` is a no-op and
    no capacity is declared to LMCache: the store evicts least recently used chunks itself.
    """

    def __init__(self, config: KVMoveL2AdapterConfig | dict,
                 l1_memory_desc: Any = None) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = KVMoveL2AdapterConfig.from_dict(config)
        self._config = config
        # The L1 arena (l1_memory_desc) is not wrapped: see chunk_store.py.
        self._chunks: ChunkStore | None = None
        if config.chunk_bytes is not None:
            self._chunks = ChunkStore(config.store, config.chunk_bytes, config.namespace)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvmove-l2")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, Any] = {}
        self._results: dict[int, Any] = {}
        self._notifiers = {name: create_event_notifier() for name in ("store", "lookup", "load")}

    def get_store_event_fd(self) -> int:
        return int(self._notifiers["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._notifiers["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._notifiers["load"].fileno())

    def submit_store_task(self, keys: list, objects: list) -> int:
        return self._submit("store", self._store, keys, objects)

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list, group_layout_descs: dict) -> int:
        return self._submit("lookup", self._lookup, keys)

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._results.pop(task_id, None)

    def submit_unlock(self, keys: list) -> None:
        """Nothing to do: lookups lock nothing (the class docstring)."""

    def submit_load_task(self, keys: list, objects: list) -> int:
        return self._submit("load", self._load, keys, objects)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._results.pop(task_id, None)

    def _submit(self, kind: str, fn: Callable[..., Any], *args: Any) -> int:
        task_id = next(self._ids)
        self._io.submit(self._run, kind, task_id, fn, *args)
        return task_id

    def _run(self, kind: str, task_id: int, fn: Callable[..., Any], *args: Any) -> None:
        try:
            result = fn(*args)
        except Exception:  # noqa: BLE001 - a failed task is reported to LMCache, not raised
            logger.exception("kvmove L2 %s task %d failed", kind, task_id)
            result = L2StoreResult(False, 0) if kind == "store" else Bitmap(len(args[0]))
        with self._lock:
            (self._stores if kind == "store" else self._results)[task_id] = result
        self._notifiers[kind].notify()

    def _store(self, keys: list, objects: list) -> Any:
        payloads = [_as_bytes(obj) for obj in objects]
        if self._chunks is None and payloads:
            self._chunks = ChunkStore(self._config.store, max(p.nbytes for p in payloads),
                                      self._config.namespace)
        if self._chunks is None:
            return L2StoreResult(True, 0)
        held = self._chunks.put([object_key_string(k) for k in keys], payloads)
        stored = [(k, p.nbytes) for k, p, h in zip(keys, payloads, held) if h]
        if stored:
            self._notify_keys_stored([k for k, _ in stored], [n for _, n in stored])
        # A full store keeps what fits: the task succeeds with the bytes it kept.
        return L2StoreResult(True, sum(n for _, n in stored))

    def _lookup(self, keys: list) -> Any:
        found = Bitmap(len(keys))
        if self._chunks is not None:
            for i, hit in enumerate(self._chunks.contains([object_key_string(k)
                                                           for k in keys])):
                if hit:
                    found.set(i)
        return found

    def _load(self, keys: list, objects: list) -> Any:
        loaded = Bitmap(len(keys))
        if self._chunks is None:
            return loaded
        outs: list[np.ndarray | None] = [_as_bytes(obj) for obj in objects]
        got = self._chunks.get([object_key_string(k) for k in keys], outs)
        for i, payload in enumerate(got):
            if payload is not None:
                loaded.set(i)
        self._notify_keys_accessed([k for k, p in zip(keys, got) if p is not None])
        return loaded

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._chunks is not None:
            self._chunks.close()
        for notifier in self._notifiers.values():
            notifier.close()


# --- the remote-storage plugin (v1 StorageManager, in-process) ------------------------------


class KVMoveConnectorAdapter(ConnectorAdapter):  # type: ignore[misc, unused-ignore]
    """Builds a ``KVMoveConnector`` for ``plugin://kvmove`` (or ``kvmove.<instance>``)."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        prefix = "plugin://"
        return url.startswith(prefix) and extract_plugin_type(url[len(prefix):]) == PLUGIN_TYPE

    def create_connector(self, context: Any) -> KVMoveConnector:
        assert isinstance(context, ConnectorContext)
        return KVMoveConnector(context.loop, context.local_cpu_backend, context.config,
                               context.metadata, context.plugin_name or PLUGIN_TYPE)


class KVMoveConnector(RemoteConnector):  # type: ignore[misc, unused-ignore]
    """A ``RemoteConnector`` over a ``ChunkStore``: a chunk is stored with LMCache's own
    header (``RemoteMetadata``: length, shapes, dtypes, format), so partial chunks come back
    with their shapes. Its store operations run on one thread of its own.

    Config: ``extra_config`` keys ``remote_storage_plugin.<name>.host_gb`` (default 1; 0: no
    host tier), ``.disk_path``, ``.disk_gb``, ``.staging_chunks`` (default 64).

    Raises:
        ConfigError: a bad value, naming its key.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 metadata: Any, plugin_name: str) -> None:
        super().__init__(config, metadata)
        prefix = f"remote_storage_plugin.{plugin_name}."
        extra = dict(config.extra_config or {})
        host, path, disk, staging = (prefix + k for k in _SETTINGS)
        store = ChunkStoreConfig.from_gb(extra, (host, path, disk, staging))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._chunks = ChunkStore(store, self.remote_metadata_bytes + self.full_chunk_size_bytes,
                                  namespace=f"lmcache-v1:{metadata.model_name}")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvmove-lmcache")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def exists(self, key: Any) -> bool:
        return bool(await self._call(self.exists_sync, key))

    def exists_sync(self, key: Any) -> bool:
        return self._chunks.contains([key.to_string()])[0]

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._call(self._put, key, memory_obj)

    def _put(self, key: Any, memory_obj: Any) -> None:
        data = _as_bytes(memory_obj)
        header = RemoteMetadata(data.nbytes, memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                memory_obj.get_memory_format()).serialize()
        record = np.concatenate([np.frombuffer(header, np.uint8), data])
        if not self._chunks.put([key.to_string()], [record])[0]:
            logger.debug("kvmove did not keep %s (larger than a chunk?)", key)

    async def get(self, key: Any) -> Any:
        return await self._call(self._get, key)

    def _get(self, key: Any) -> Any:
        record = self._chunks.get([key.to_string()], [None])[0]
        if record is None:
            return None
        meta = RemoteMetadata.deserialize(record[:self.remote_metadata_bytes].tobytes())
        memory_obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if memory_obj is None:
            logger.debug("no L1 memory to load %s into", key)
            return None
        out = _as_bytes(memory_obj)
        payload = record[self.remote_metadata_bytes:]
        if out.nbytes != payload.nbytes or meta.length != payload.nbytes:
            memory_obj.ref_count_down()
            return None
        out[:] = payload
        return memory_obj

    def remove_sync(self, key: Any) -> bool:
        """False: the store has no delete (it evicts least recently used chunks itself)."""
        return False

    async def list(self) -> list[str]:
        return []  # the store keeps hashes, not LMCache's keys

    async def close(self) -> None:
        self._io.shutdown(wait=True)
        self._chunks.close()

    def __repr__(self) -> str:
        return f"<KVMoveConnector {self._chunks.store!r}>"
