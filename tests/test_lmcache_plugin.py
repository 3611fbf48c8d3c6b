"""kvmove's LMCache plugins (kvmove/integrations/lmcache.py) inside real LMCache 0.5.6 on CPU:
its own ``lmcache bench l2`` with verification, its v1 ``StorageManager`` with the remote
storage plugin, a corrupted block, and every rejected config. .ci/lmcache runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("lmcache", reason="needs LMCache 0.5.6: see .ci/lmcache for the CPU install "
                                      "(pip install --no-deps lmcache==0.5.6 and its deps)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmcache.cli.commands.bench.l2_adapter_bench.data import (  # noqa: E402
    make_memory_objects,
    make_object_keys,
    wait_eventfd,
)
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class  # noqa: E402
from lmcache.v1.distributed.l2_adapters.factory import (  # noqa: E402
    create_l2_adapter_from_registry,
)
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import ConnectorContext  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from kvmove.errors import ConfigError  # noqa: E402
from kvmove.integrations.chunk_store import HEADER_NBYTES, key_digest  # noqa: E402
from kvmove.integrations.lmcache import (  # noqa: E402
    KVMoveConnectorAdapter,
    KVMoveL2Adapter,
    object_key_string,
)

MODULE = "kvmove.integrations.lmcache"
ENV = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_USAGE_TRACK": "False"}
CHUNK_TOKENS = 16
SHAPE = torch.Size([2, 2, CHUNK_TOKENS, 16])  # KV_2LTD: [K/V, layers, tokens, hidden] fp16
CHUNK_NBYTES = 2 * 2 * CHUNK_TOKENS * 16 * 2  # 2 KiB


def _plugin(params: dict) -> dict:
    return {"type": "plugin", "module_path": MODULE, "class_name": "KVMoveL2Adapter",
            "adapter_params": params}


# --- the L2 adapter, by LMCache's own benchmark ---------------------------------------------


def test_bench_l2_round_trips_with_verification(tmp_path):
    """`lmcache bench l2` stores, looks up and loads 3 rounds of 32 objects of 64 KB through
    the plugin (host tier of 1 MiB: most go down to the disk tier) and verifies the last
    round byte for byte; it exits 1 when verification fails."""
    spec = _plugin({"host_gb": 1 / 1024, "disk_path": str(tmp_path / "l2"), "disk_gb": 0.05})
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter",
         json.dumps(spec), "--num-keys", "32", "--data-size-kb", "64", "--rounds", "2",
         "--warmup-rounds", "1", "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
         "--format", "json", "--output", str(out)],
        capture_output=True, text=True, env=ENV, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[Verify] All 32 keys data verified OK." in run.stdout
    ops = {op["operation"]: op for op in json.loads(out.read_text())["metrics"].values()
           if isinstance(op, dict) and "operation" in op}
    for name in ("Store", "Load"):
        assert ops[name]["total_success"] == ops[name]["total_keys"] == 64, ops[name]
        assert ops[name]["throughput_avg_mbps"] > 0
    assert ops["Lookup"]["total_success"] > 0  # lookups of stored keys found them


# --- the L2 adapter, in process ----------------------------------------------------------------


def _wait(adapter, fd, query, task):
    assert wait_eventfd(fd, timeout=30.0)
    result = query(task)
    while result is None:  # another task's signal woke us first
        assert wait_eventfd(fd, timeout=30.0)
        result = query(task)
    return result


def _store(adapter, keys, objects):
    task = adapter.submit_store_task(keys, objects)
    assert wait_eventfd(adapter.get_store_event_fd(), timeout=30.0)
    done = adapter.pop_completed_store_tasks()
    return done[task]


def _load(adapter, keys, objects):
    task = adapter.submit_load_task(keys, objects)
    bitmap = _wait(adapter, adapter.get_load_event_fd(), adapter.query_load_result, task)
    return [bitmap.test(i) for i in range(len(keys))]


def _corrupt(adapter, key, offset):
    """Flips one payload byte of ``key``'s block in the host tier's memory."""
    tier = adapter._chunks.store._tiers[0]
    slot = tier.index[key_digest(object_key_string(key))[0]][0]
    row = tier.cache.numpy().reshape(tier.cache.num_blocks, -1)[slot]
    row[HEADER_NBYTES + offset] ^= 0xFF


@pytest.mark.parametrize("corrupt", [False, True])
def test_corrupted_block_is_not_served(corrupt):
    """A stored block with one byte flipped fails the store's checksum: its load reports a
    miss and leaves the buffer as it was, while the intact key of the same task loads.
    ``corrupt=False`` is the control: without the flip both load (the test can fail)."""
    adapter = KVMoveL2Adapter({"host_gb": 0.01})
    try:
        keys = make_object_keys(2)
        source = torch.empty(2 * 4096, dtype=torch.uint8)
        assert _store(adapter, keys, make_memory_objects(source, 2, 4096, 0)).is_successful()
        if corrupt:
            _corrupt(adapter, keys[0], offset=100)
        dest = torch.zeros(2 * 4096, dtype=torch.uint8)
        loaded = _load(adapter, keys, make_memory_objects(dest, 2, 4096, 0, fill_offset=7))
        assert loaded == [not corrupt, True]
        assert torch.equal(dest[4096:], source[4096:])
        if corrupt:
            assert (dest[:4096] == 7).all()  # untouched: make_memory_objects' fill
            assert adapter._chunks.store.stats().tiers["host"].corrupt == 1
            assert _load(adapter, keys[:1], make_memory_objects(dest, 1, 4096, 0)) == [False]
        else:
            assert torch.equal(dest, source)
    finally:
        adapter.close()


def test_full_store_is_back_pressure_not_an_error():
    """A host tier of 4 objects given 10: the task succeeds with the bytes kept, the oldest
    are evicted (least recently used), the newest load."""
    adapter = KVMoveL2Adapter({"host_gb": 4 * (4096 + HEADER_NBYTES) / 2**30,
                               "chunk_bytes": 4096})
    try:
        keys = make_object_keys(10)
        source = torch.empty(10 * 4096, dtype=torch.uint8)
        for i in range(10):
            result = _store(adapter, keys[i:i + 1], make_memory_objects(source, 1, 4096,
                                                                        i * 4096, i))
            assert result.is_successful() and result.bytes_transferred() == 4096
        dest = torch.zeros(10 * 4096, dtype=torch.uint8)
        loaded = _load(adapter, keys, [make_memory_objects(dest, 1, 4096, i * 4096, 99)[0]
                                       for i in range(10)])
        assert loaded == [False] * 6 + [True] * 4
        assert torch.equal(dest[6 * 4096:], source[6 * 4096:])
    finally:
        adapter.close()


# --- the remote-storage plugin in LMCache's v1 StorageManager --------------------------------


def _manager(extra: dict) -> StorageManager:
    prefix = "remote_storage_plugin.kvmove."
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": 0.01,
        "remote_storage_plugins": ["kvmove"],
        "extra_config": {prefix + "module_path": MODULE,
                         prefix + "class_name": "KVMoveConnectorAdapter",
                         **{prefix + k: v for k, v in extra.items()}}})
    metadata = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.float16,
                               kv_shape=(2, 2, CHUNK_TOKENS, 2, 8), role="worker",
                               chunk_size=CHUNK_TOKENS)
    return StorageManager(config, metadata, EventManager())


def _put_chunks(manager, n):
    keys = [CacheEngineKey("tiny", 1, 0, 1000 + i, torch.float16) for i in range(n)]
    chunks = []
    for key in keys:
        obj = manager.allocate(SHAPE, torch.float16, fmt=MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(SHAPE, dtype=torch.float16))
        chunks.append(obj.tensor.clone())
        _put(manager, key, obj)  # one at a time: the store's LRU order is the put order
    return keys, chunks


def _put(manager, key, obj):
    """Puts one chunk (into L1 and kvmove) and waits for kvmove's copy."""
    manager.batched_put([key], [obj])
    remote = manager.storage_backends["RemoteBackend-kvmove"]
    deadline = time.monotonic() + 30.0
    while remote.exists_in_put_tasks(key) and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_storage_manager_put_evict_get(tiers, tmp_path):
    """Chunks put through the StorageManager go to L1 and to kvmove; evicted from L1 they come
    back from kvmove byte for byte. The host tier holds 5 chunks of 8: with a disk tier below
    it every chunk comes back, without one the 3 least recently used were evicted."""
    extra = {"host_gb": 5 * (HEADER_NBYTES + 28 + CHUNK_NBYTES) / 2**30}
    if tiers == "host+disk":
        extra |= {"disk_path": str(tmp_path / "v1"), "disk_gb": 0.01}
    manager = _manager(extra)
    try:
        keys, chunks = _put_chunks(manager, 8)
        manager.batched_remove(keys, locations=["LocalCPUBackend"])
        assert not any(manager.local_cpu_backend.contains(k) for k in keys)
        kept = range(8) if tiers == "host+disk" else range(3, 8)
        for i, key in enumerate(keys):
            obj = manager.get(key)
            assert (obj is not None) == (i in kept), i
            if obj is not None:
                assert torch.equal(obj.tensor, chunks[i])
                assert obj.get_shapes() == [SHAPE]
                obj.ref_count_down()
    finally:
        manager.close()


def test_storage_manager_partial_chunk_keeps_its_shape():
    """A chunk of 5 tokens (a prompt's last, under save_unfull_chunk) comes back with its own
    shape: the record carries LMCache's RemoteMetadata."""
    manager = _manager({"host_gb": 0.001})
    try:
        shape = torch.Size([2, 2, 5, 16])
        key = CacheEngineKey("tiny", 1, 0, 77, torch.float16)
        obj = manager.allocate(shape, torch.float16, fmt=MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(shape, dtype=torch.float16))
        expected = obj.tensor.clone()
        _put(manager, key, obj)
        manager.batched_remove([key], locations=["LocalCPUBackend"])
        got = manager.get(key)
        assert got is not None and got.get_shapes() == [shape]
        assert torch.equal(got.tensor, expected)
        got.ref_count_down()
    finally:
        manager.close()


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("params, named", [
    ({"host_gb": "lots"}, "host_gb must be a number of GB, got 'lots'"),
    ({"host_gb": -1}, "host_gb must be a finite number of GB >= 0, got -1"),
    ({"disk_path": "/tmp/x"}, "disk_gb must be an integer >= 1, got 0"),
    ({"disk_path": "", "disk_gb": 1}, "disk_path must be a non-empty directory path, got ''"),
    ({"host_gb": 0}, "no tier: host_gb is 0 and disk_path is not set"),
    ({"staging_chunks": 0}, "staging_chunks must be an integer >= 1, got 0"),
    ({"chunk_bytes": "4k"}, "chunk_bytes must be a positive integer, got '4k'"),
    ({"host_gib": 1}, "unknown kvmove L2 adapter parameter(s) ['host_gib']"),
])
def test_l2_bad_config_raises(params, named):
    """LMCache's own config path (plugin config -> our config class) raises ConfigError,
    which is a ValueError as LMCache's configs raise, naming the key and the value."""
    config = get_l2_adapter_config_class("plugin").from_dict(_plugin(params))
    with pytest.raises(ConfigError) as raised:
        create_l2_adapter_from_registry(config)
    assert named in str(raised.value)


def test_v1_bad_config_raises():
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK_TOKENS, "remote_storage_plugins": ["kvmove"],
        "extra_config": {"remote_storage_plugin.kvmove.host_gb": "1GB"}})
    metadata = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.float16,
                               kv_shape=(2, 2, CHUNK_TOKENS, 2, 8), role="worker",
                               chunk_size=CHUNK_TOKENS)
    context = ConnectorContext("plugin://kvmove", loop=None, local_cpu_backend=None,
                               config=config, metadata=metadata, plugin_name="kvmove")
    adapter = KVMoveConnectorAdapter()
    assert adapter.can_parse("plugin://kvmove") and adapter.can_parse("plugin://kvmove.b")
    assert not adapter.can_parse("plugin://kvmovex") and not adapter.can_parse("plugin://fs")
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.kvmove\.host_gb must be a "
                                          r"number of GB, got '1GB'"):
        adapter.create_connector(context)


# --- keys and imports -------------------------------------------------------------------------


def test_keys_map_to_fixed_digests():
    """The mapping is a pure function of every key field (the same in every process: a disk
    tier's chunks are found after a restart)."""
    key = make_object_keys(1)[0]
    assert object_key_string(key) == "00000000000000000000000000000000@bench-model@0@0@"
    salted = type(key)(key.chunk_hash, key.model_name, key.kv_rank, cache_salt="alice")
    assert key_digest(object_key_string(key))[0] != key_digest(object_key_string(salted))[0]
    assert key_digest("a") == key_digest("a")
    assert key_digest("a")[0] == int.from_bytes(
        __import__("hashlib").blake2b(b"a", digest_size=24).digest()[:8], "little")
    assert np.uint64(key_digest("a")[0]) == key_digest("a")[0]  # fits 64 bits


def test_import_kvmove_does_not_import_lmcache(tmp_path):
    code = "import sys, kvmove, kvmove.integrations; assert 'lmcache' not in sys.modules"
    # Outside the checkout, as the bench: `python -c` puts its cwd first on sys.path, and
    # CI's checkout has no compiled core (the installed kvmove is the one under test).
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=60, cwd=tmp_path)
