"""kvmove's SGLang HiCache backend (kvmove/integrations/sglang.py) as SGLang loads and drives
it: created by SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` with
``interface_v1`` set, then pages round-tripped through ``batch_set_v1`` / ``batch_get_v1``
and compared byte for byte with the pages SGLang's host pool holds.

The host pool: SGLang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` cannot be imported
here: their module imports ``sglang.srt.configs``, whose vision-model configs import
torchvision, and PyPI's torchvision is a CUDA build that fails against CPU torch
("operator torchvision::nms does not exist"). ``HostPool`` below carries the attributes the
backend reads, with ``kv_buffer`` allocated in the dims SGLang's ``init_kv_buffer`` gives each
layout, and ``page`` reads a page as SGLang's ``get_data_page`` does: the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="needs SGLang's HiCache storage layer: "
                           "pip install --no-deps sglang==0.5.23 (.ci/sglang)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvmove import _C  # noqa: E402
from kvmove.errors import ConfigError  # noqa: E402
from kvmove.integrations.sglang import KVMoveHiCacheStorage, key_hash  # noqa: E402

LAYERS, HEADS, DIM, PAGE, PAGES = 3, 2, 8, 4, 8
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass
class HostPool:
    """SGLang's host KV pool as the backend sees it (see the module docstring)."""

    layout: str
    mla: bool
    dtype: torch.dtype = torch.bfloat16
    page_size: int = PAGE
    layer_num: int = LAYERS
    head_num: int = HEADS
    head_dim: int = DIM
    v_head_dim: int = DIM
    size: int = PAGES * PAGE

    def __post_init__(self) -> None:
        if self.mla:
            self.kv_cache_dim = 2 * DIM
        self.kv_buffer = torch.empty(self._dims(), dtype=self.dtype)

    def _dims(self) -> tuple[int, ...]:
        """SGLang 0.5.23's init_kv_buffer (pool_host/mha.py, pool_host/mla.py)."""
        L, T, H, D, S, P = self.layer_num, self.size, HEADS, DIM, PAGE, PAGES
        if self.mla:
            W = 2 * D
            return {"layer_first": (L, T, 1, W), "page_first": (T, L, 1, W),
                    "page_first_direct": (P, L, S, 1, W)}[self.layout]
        return {"layer_first": (2, L, T, H, D), "page_first": (2, T, L, H, D),
                "page_first_direct": (2, P, L, S, H, D),
                "page_head": (2, P, H, S, L, D), "page_unified": (P, 2 * L * S * H * D)}[
                    self.layout]

    def page(self, index: int) -> torch.Tensor:
        """The page at token ``index``, as SGLang's get_data_page(index) reads it."""
        kv, i, p = self.kv_buffer, index, index // PAGE
        if self.layout in ("page_first_direct", "page_head"):
            page = kv[p:p + 1] if self.mla else kv[:, p:p + 1]
        elif self.layout == "page_first":
            page = kv[i:i + PAGE] if self.mla else kv[:, i:i + PAGE]
        else:  # layer_first
            page = kv[:, i:i + PAGE] if self.mla else kv[:, :, i:i + PAGE]
        return page.clone()


def sglang_config(extra: dict | None, *, mla: bool = False, tp_size: int = 1,
                  model: str = "test-model") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=model, extra_config=extra)


def dynamic(**ours: object) -> dict:
    """extra_config as SGLang's --hicache-storage-backend-extra-config gives it."""
    return {"backend_name": "kvmove", "module_path": "kvmove.integrations.sglang",
            "class_name": "KVMoveHiCacheStorage", "interface_v1": 1, **ours}


def backend_for(pool: HostPool, **ours: object) -> KVMoveHiCacheStorage:
    """Created as SGLang's HiCacheController does: the factory, then register_mem_pool_host."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", sglang_config(dynamic(**ours), mla=pool.mla), None)
    assert type(backend) is KVMoveHiCacheStorage  # no failure injector in between
    backend.register_mem_pool_host(pool)
    return backend


def indices(pages: list[int]) -> torch.Tensor:
    """SGLang's host_indices for whole pages: page_size token indices per page."""
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def fill(pool: HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


def page_bytes(pool: HostPool) -> int:
    return pool.page(0).numel() * pool.page(0).element_size()


def disk_slot_bytes(pool: HostPool) -> int:
    """A page on disk: its slot is rounded up to the block file's alignment (O_DIRECT)."""
    align = _C.BlockFile.SLOT_ALIGN
    return -(-page_bytes(pool) // align) * align


@pytest.mark.parametrize("mla,layout", [(False, lay) for lay in MHA_LAYOUTS]
                         + [(True, lay) for lay in MLA_LAYOUTS])
def test_round_trip_through_v1_equals_sglang_pages(mla: bool, layout: str) -> None:
    pool = HostPool(layout, mla)
    backend = backend_for(pool, host_bytes=PAGES * page_bytes(pool))
    fill(pool, seed=1)
    src = [5, 0, 3]
    expected = [pool.page(p * PAGE) for p in src]
    keys = ["a" * 64, "b" * 64, "c" * 64]
    assert backend.batch_set_v1(keys, indices(src)) == [True, True, True]

    pool.kv_buffer.zero_()
    dst = [1, 7, 2]
    assert backend.batch_get_v1(keys, indices(dst)) == [True, True, True]
    for p, want in zip(dst, expected):
        assert torch.equal(pool.page(p * PAGE).view(torch.uint8), want.view(torch.uint8))
    untouched = [p for p in range(PAGES) if p not in dst]
    assert all(not pool.page(p * PAGE).any() for p in untouched)
    backend.close()


def test_batch_exists_reports_the_leading_stored_run() -> None:
    pool = HostPool("page_first", mla=False)
    backend = backend_for(pool, host_bytes=PAGES * page_bytes(pool))
    fill(pool, seed=2)
    backend.batch_set_v1(["k0", "k1", "k2"], indices([0, 1, 2]))
    assert backend.batch_exists(["k0", "k1", "k2"]) == 3
    assert backend.batch_exists(["k0", "k1", "missing", "k2"]) == 2
    assert backend.batch_exists(["missing", "k0"]) == 0
    assert backend.exists("k1") and not backend.exists("missing")
    # get stops at the first missing page: only the leading ones are reported
    assert backend.batch_get_v1(["k0", "missing", "k2"], indices([4, 5, 6])) == [
        True, False, False]


def test_a_full_store_reports_not_stored_and_evicts_least_recently_used() -> None:
    pool = HostPool("layer_first", mla=False)
    backend = backend_for(pool, host_bytes=2 * page_bytes(pool) + 1)  # room for 2 pages
    fill(pool, seed=3)
    assert backend.batch_set_v1(["a", "b", "c"], indices([0, 1, 2])) == [True, True, False]
    assert backend.batch_exists(["a"]) == 1  # a is now more recently used than b
    assert backend.batch_set_v1(["d"], indices([3])) == [True]
    assert [backend.exists(k) for k in "abcd"] == [True, False, False, True]
    want = pool.page(3 * PAGE)
    assert backend.batch_get_v1(["d"], indices([6])) == [True]
    assert torch.equal(pool.page(6 * PAGE).view(torch.uint8), want.view(torch.uint8))


def test_disk_tier_serves_demoted_pages_and_a_restarted_backend(tmp_path) -> None:
    pool = HostPool("page_first_direct", mla=False)
    disk = {"disk_dir": str(tmp_path), "disk_bytes": 8 * disk_slot_bytes(pool),
            "disk_direct": False}
    backend = backend_for(pool, host_bytes=page_bytes(pool), **disk)
    fill(pool, seed=4)
    keys = [f"p{i}" for i in range(4)]
    expected = [pool.page(p * PAGE) for p in range(4)]
    assert backend.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    backend.close()

    # The host tier held p0 (the leading page); p1..p3 went to disk. A new server on the same
    # folder has the disk's pages only.
    restarted = backend_for(pool, **disk)
    pool.kv_buffer.zero_()
    assert restarted.batch_exists(keys) == 0 and restarted.batch_exists(keys[1:]) == 3
    assert restarted.batch_get_v1(keys[1:], indices([4, 5, 6])) == [True] * 3
    for p, want in zip([4, 5, 6], expected[1:]):
        assert torch.equal(pool.page(p * PAGE).view(torch.uint8), want.view(torch.uint8))
    assert restarted.clear() and restarted.batch_exists(keys[1:]) == 0
    restarted.close()


def test_a_corrupted_stored_page_is_not_served(tmp_path) -> None:
    pool = HostPool("layer_first", mla=True)
    backend = backend_for(pool, disk_dir=str(tmp_path), disk_bytes=4 * disk_slot_bytes(pool),
                          disk_direct=False)
    fill(pool, seed=5)
    assert backend.batch_set_v1(["x", "y"], indices([0, 1])) == [True, True]
    backend.store.flush()
    assert backend.batch_get_v1(["x", "y"], indices([2, 3])) == [True, True]  # intact: served
    data = next(str(p) for p in tmp_path.rglob("blocks.dat"))
    with open(data, "r+b") as f:  # flip every byte of the stored pages
        raw = bytearray(f.read())
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in raw))
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(["x", "y"], indices([2, 3])) == [False, False]
    assert not pool.page(3 * PAGE).any()  # nothing past the corrupt page was written
    assert backend.batch_exists(["x"]) == 0  # dropped, never served again
    backend.close()


@pytest.mark.parametrize("ours,key", [
    ({"host_bytes": "4GiB"}, "'host_bytes'"),
    ({"host_bytes": 0}, "'host_bytes'"),
    ({"host_bytes": True}, "'host_bytes'"),
    ({"disk_dir": "/tmp/kv"}, "'disk_bytes'"),
    ({"disk_dir": "", "disk_bytes": 1 << 20}, "'disk_dir'"),
    ({}, "'host_bytes'"),
    ({"host_bytes": 1 << 20, "disk_direct": "yes"}, "'disk_direct'"),
    ({"host_bytes": 1 << 20, "io_timeout": 0}, "'io_timeout'"),
    ({"host_bytes": 1 << 20, "io_timeout": "60"}, "'io_timeout'"),
])
def test_bad_extra_config_names_the_key(ours: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        StorageBackendFactory.create_backend("dynamic", sglang_config(dynamic(**ours)), None)


def test_without_interface_v1_it_says_v1_is_required() -> None:
    extra = dynamic(host_bytes=1 << 20)
    del extra["interface_v1"]
    with pytest.raises(ConfigError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", sglang_config(extra), None)


def test_a_capacity_under_one_page_is_refused_at_registration() -> None:
    pool = HostPool("layer_first", mla=False)
    with pytest.raises(ConfigError, match=r"'host_bytes'\] = 100 holds no page"):
        backend_for(pool, host_bytes=100)


def test_unsupported_pool_layout_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="page_unified"):
        backend_for(HostPool("page_unified", mla=False), host_bytes=1 << 20)


def test_mla_across_tp_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="tp_size 2"):
        StorageBackendFactory.create_backend(
            "dynamic", sglang_config(dynamic(host_bytes=1 << 20), mla=True, tp_size=2), None)


def test_host_indices_that_are_not_whole_pages_are_refused() -> None:
    pool = HostPool("layer_first", mla=False)
    backend = backend_for(pool, host_bytes=1 << 20)
    with pytest.raises(ConfigError, match="not one whole page"):
        backend.batch_set_v1(["a"], indices([1]) + 1)
    with pytest.raises(ConfigError, match="expected 8"):
        backend.batch_set_v1(["a", "b"], indices([1]))


def test_key_hash_is_stable_across_processes() -> None:
    # A disk tier written by one server is read by the next: the mapping must not change.
    # Constants, not recomputed: a change of digest would strand every stored page.
    assert key_hash("") == 0xE4A6A0577479B2B4
    assert key_hash("0" * 64) == 0xDE4D7977BD8B8493
    assert len({key_hash(f"{i:064x}") for i in range(10_000)}) == 10_000


def test_import_kvmove_does_not_import_sglang() -> None:
    import subprocess
    import sys
    code = "import sys, kvmove; sys.exit('sglang' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd="/").returncode == 0


def test_a_put_or_get_that_outlives_io_timeout_raises_rather_than_return() -> None:
    """SGLang reuses the host pages when the call returns: a store I/O still running at the
    deadline is an error, never a silent return (and never a wait without end)."""
    from concurrent.futures import Future

    from kvmove.errors import TimeoutError as KVMoveTimeout
    from kvmove.integrations.sglang import _wait
    from kvmove.store import StoreHandle

    never: Future = Future()   # an I/O that does not finish
    with pytest.raises(KVMoveTimeout, match=r"get of 3 pages took over io_timeout = 0.2 s"):
        _wait(StoreHandle(never), "get", 3, 0.2)
    done: Future = Future()
    done.set_result(3)
    assert _wait(StoreHandle(done), "put", 3, 0.2) == 3
