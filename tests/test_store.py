"""KVStore: host and disk tiers keyed by block hash, against numpy copies of the blocks.

Every block that comes back is compared byte for byte with a reference copy of the block that
was put; a block the store cannot vouch for (corrupt, torn, truncated, evicted) must come back
as a miss, and its destination block must keep its previous content.
"""

from __future__ import annotations

import gc
import math
import os
import struct
import subprocess
import threading

import numpy as np
import pytest

import kvmove
from kvmove import DiskTier, HostTier, KVCache, KVSpec, KVStore, Lookup, StoreHandle
from kvmove.errors import ConfigError, StoreError, TimeoutError

# 2 layers x 16 tokens x 2 (K, V) x 2 heads x 8 dims x 4 B = 4096 B per block: one slot exactly.
LAYOUT = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
# 3 layers x 16 x 2 x 2 x 12 x 4 B = 9216 B per block: a 12288 B slot, 3072 B of padding.
ODD = KVSpec(num_layers=3, num_kv_heads=2, head_dim=12, dtype="float32", block_size=16)
LAYOUTS = [pytest.param(LAYOUT, id="4096B"), pytest.param(ODD, id="9216B")]
SENTINEL = -7.0  # what destination blocks hold before a get
WAIT = 30.0


def slot_nbytes(layout: KVSpec) -> int:
    return -(-layout.bytes_per_block // 4096) * 4096


def host(layout: KVSpec, blocks: int) -> HostTier:
    return HostTier(blocks * layout.bytes_per_block)


def disk(path, layout: KVSpec, blocks: int, **kw) -> DiskTier:
    return DiskTier(str(path), blocks * slot_nbytes(layout), **kw)


def tiers_for(kind: str, layout: KVSpec, path, host_blocks: int = 16,
              disk_blocks: int = 16) -> list:
    return {
        "host": lambda: [host(layout, host_blocks)],
        "disk": lambda: [disk(path, layout, disk_blocks)],
        "host+disk": lambda: [host(layout, host_blocks), disk(path, layout, disk_blocks)],
    }[kind]()


def random_cache(layout: KVSpec, num_blocks: int, seed: int = 0) -> KVCache:
    cache = KVCache(layout, num_blocks)
    cache.numpy()[...] = np.random.default_rng(seed).random(cache.shape, dtype=np.float32)
    return cache


def blank_cache(layout: KVSpec, num_blocks: int) -> KVCache:
    cache = KVCache(layout, num_blocks)
    cache.numpy()[...] = SENTINEL
    return cache


def block_bytes(cache: KVCache, block_id: int) -> bytes:
    """A block as a disk slot holds it: every layer's K and V, layer after layer."""
    return np.ascontiguousarray(cache.numpy()[:, block_id]).tobytes()


def same_block(dst: KVCache, dst_id: int, ref: np.ndarray, ref_id: int) -> bool:
    return np.array_equal(dst.numpy()[:, dst_id], ref[:, ref_id])


def untouched(cache: KVCache, block_id: int) -> bool:
    return bool((cache.numpy()[:, block_id] == SENTINEL).all())


def hashes_for(n: int, seed: int = 0, layout: KVSpec = LAYOUT) -> list[int]:
    """Realistic chained hashes of an ``n``-block prompt."""
    tokens = np.random.default_rng(1000 + seed).integers(0, 50_000, n * layout.block_size)
    out = list(kvmove.block_hashes(tokens, layout.block_size))
    assert len(out) == n
    return out


def put(store: KVStore, hashes, cache, ids) -> int:
    return store.put(list(hashes), cache, list(ids)).wait(WAIT)


def get(store: KVStore, hashes, cache, ids) -> int:
    return store.get(list(hashes), cache, list(ids)).wait(WAIT)


def slot_holding(path, layout: KVSpec, data: bytes) -> int:
    """The slot of ``blocks.dat`` whose block bytes are ``data``."""
    raw = (path / "blocks.dat").read_bytes()
    step = slot_nbytes(layout)
    found = [s for s in range(len(raw) // step)
             if raw[s * step: s * step + layout.bytes_per_block] == data]
    assert len(found) == 1, f"expected one slot holding the block, found {found}"
    return found[0]


def flip_byte(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def src() -> KVCache:
    return random_cache(LAYOUT, 16)


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["host", "disk", "host+disk"])
def test_round_trip_scattered_ids_is_byte_exact(tmp_path, kind, layout):
    src = random_cache(layout, 12)
    ref = src.numpy().copy()
    hashes = hashes_for(6, layout=layout)
    src_ids, dst_ids = [7, 2, 9, 0, 5, 3], [1, 8, 4, 6, 10, 11]
    # host+disk: 3 host blocks, so the put keeps the leading 3 in host, the rest go to disk.
    host_blocks = 3 if kind == "host+disk" else 8
    with KVStore(layout, tiers_for(kind, layout, tmp_path, host_blocks=host_blocks)) as store:
        assert put(store, hashes, src, src_ids) == 6
        look = store.lookup(hashes)
        expected = {"host": ("host",) * 6, "disk": ("disk",) * 6,
                    "host+disk": ("host",) * 3 + ("disk",) * 3}[kind]
        assert look.tiers == expected
        assert look.num_blocks == int(look) == 6
        dst = blank_cache(layout, 12)
        assert get(store, hashes, dst, dst_ids) == 6
    for s, d in zip(src_ids, dst_ids):
        assert same_block(dst, d, ref, s)
    for d in set(range(12)) - set(dst_ids):
        assert untouched(dst, d)


@pytest.mark.parametrize("direct", [True, False])
def test_disk_round_trip_with_and_without_o_direct(tmp_path, src, direct):
    ref = src.numpy().copy()
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4, direct=direct)]) as store:
        assert put(store, hashes, src, [9, 3, 6]) == 3
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4, direct=direct)]) as store:
        dst = blank_cache(LAYOUT, 3)
        assert get(store, hashes, dst, [2, 0, 1]) == 3
    assert same_block(dst, 2, ref, 9) and same_block(dst, 0, ref, 3)
    assert same_block(dst, 1, ref, 6)


@pytest.mark.parametrize("kind", ["host", "disk", "host+disk"])
def test_get_stops_at_first_missing_block(tmp_path, src, kind):
    ref = src.numpy().copy()
    hashes = hashes_for(5)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path)) as store:
        put(store, hashes[:2], src, [0, 1])
        put(store, hashes[3:], src, [3, 4])  # hashes[2] never stored
        assert int(store.lookup(hashes)) == 2
        dst = blank_cache(LAYOUT, 8)
        assert get(store, hashes, dst, [0, 1, 2, 3, 4]) == 2
    assert same_block(dst, 0, ref, 0) and same_block(dst, 1, ref, 1)
    assert untouched(dst, 2)


def test_put_of_stored_blocks_reports_them_held(src):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [host(LAYOUT, 8)]) as store:
        assert put(store, hashes, src, [0, 1, 2]) == 3
        assert put(store, hashes, src, [0, 1, 2]) == 3
        assert store.stats().tiers["host"].stored == 3
        assert store.stats().blocks == {"host": 3}


def test_put_returns_handle_and_any_ints_are_hashes(src):
    ref = src.numpy().copy()
    hashes = [0, 1, 2**64 - 1]
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        handle = store.put(hashes, src, [3, 4, 5])
        assert isinstance(handle, StoreHandle)
        assert handle.wait(WAIT) == 3
        assert handle.done()
        dst = blank_cache(LAYOUT, 4)
        assert get(store, hashes, dst, [2, 1, 0]) == 3
    assert same_block(dst, 2, ref, 3) and same_block(dst, 1, ref, 4) and same_block(dst, 0, ref, 5)


def test_empty_put_and_get(src):
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        assert put(store, [], src, []) == 0
        assert get(store, [], src, []) == 0
        assert store.lookup([]).decision == "miss"


def test_put_larger_than_host_only_keeps_leading_blocks(src):
    ref = src.numpy().copy()
    hashes = hashes_for(6)
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        assert put(store, hashes, src, range(6)) == 4
        assert store.lookup(hashes).tiers == ("host",) * 4
        dst = blank_cache(LAYOUT, 6)
        assert get(store, hashes, dst, range(6)) == 4
    for i in range(4):
        assert same_block(dst, i, ref, i)
    assert untouched(dst, 4) and untouched(dst, 5)


def test_put_larger_than_host_keeps_its_stored_leading_block(src):
    # Host holds 2; a, b stored. put [a, c, d]: more blocks than the tier holds, so the
    # leading ones (a, c) should stay; a prefix without its first block is worth nothing.
    ref = src.numpy().copy()
    a, b = hashes_for(2, seed=4)
    c, d = hashes_for(2, seed=5)
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        put(store, [a, b], src, [0, 1])
        put(store, [a, c, d], src, [0, 2, 3])
        assert store.lookup([a, c, d]).tiers == ("host", "host")
        dst = blank_cache(LAYOUT, 3)
        assert get(store, [a, c, d], dst, [0, 1, 2]) == 2
    assert same_block(dst, 0, ref, 0) and same_block(dst, 1, ref, 2)


# --- on-disk format -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_dat_holds_each_block_in_a_padded_slot(tmp_path, layout):
    src = random_cache(layout, 6)
    step = slot_nbytes(layout)
    with KVStore(layout, [disk(tmp_path, layout, 8)]) as store:
        put(store, hashes_for(6, layout=layout), src, [5, 0, 3, 1, 4, 2])
    assert {p.name for p in tmp_path.iterdir()} >= {"blocks.dat", "index.kvm", "lock"}
    raw = (tmp_path / "blocks.dat").read_bytes()
    assert len(raw) == 8 * step
    slots = [slot_holding(tmp_path, layout, block_bytes(src, b)) for b in [5, 0, 3, 1, 4, 2]]
    assert len(set(slots)) == 6
    for s in slots:
        assert raw[s * step + layout.bytes_per_block:(s + 1) * step] == bytes(
            step - layout.bytes_per_block)


@pytest.mark.parametrize(("layout", "host_bytes", "disk_bytes", "host_blocks", "disk_blocks"), [
    (LAYOUT, 3 * 4096 + 4095, 5 * 4096 + 4095, 3, 5),
    (ODD, 3 * 9216 + 9215, 5 * 12288 + 12287, 3, 5),
    (ODD, 4 * 9216, 3 * 12288, 4, 3),
])
def test_capacities_round_down_to_whole_blocks(tmp_path, layout, host_bytes, disk_bytes,
                                               host_blocks, disk_blocks):
    tiers = [HostTier(host_bytes), DiskTier(str(tmp_path), disk_bytes)]
    with KVStore(layout, tiers) as store:
        assert store.stats().capacity_blocks == {"host": host_blocks, "disk": disk_blocks}
    assert (tmp_path / "blocks.dat").stat().st_size == disk_blocks * slot_nbytes(layout)


# --- LRU eviction, demotion, capacity -----------------------------------------------------


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize("touch", ["get", "put", "lookup"])
def test_eviction_is_lru_and_a_touched_block_survives(tmp_path, src, kind, touch):
    a, b, c, d = hashes_for(4)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path, host_blocks=3, disk_blocks=3)) as store:
        for h, i in [(a, 0), (b, 1), (c, 2)]:
            put(store, [h], src, [i])
        if touch == "get":
            get(store, [a], blank_cache(LAYOUT, 1), [0])
        elif touch == "put":
            put(store, [a], src, [0])
        else:
            store.lookup([a])
        put(store, [d], src, [3])  # full: the least recently used block (b) goes
        assert int(store.lookup([a])) == 1
        assert int(store.lookup([b])) == 0
        assert int(store.lookup([c])) == 1 and int(store.lookup([d])) == 1
        assert store.stats().tiers[kind].evicted == 1


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_oldest_block_goes_first_without_touches(tmp_path, src, kind):
    hashes = hashes_for(6)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path, host_blocks=4, disk_blocks=4)) as store:
        for i, h in enumerate(hashes):
            put(store, [h], src, [i])
        held = [h for h in hashes if int(store.lookup([h]))]
        assert held == hashes[2:]


def test_demoted_block_is_found_on_disk_and_byte_exact(tmp_path, src):
    ref = src.numpy().copy()
    a, b, c = hashes_for(3)
    with KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, [a], src, [5])
        put(store, [b], src, [6])
        put(store, [c], src, [7])  # host full: a is demoted to disk
        assert store.lookup([a]).tiers == ("disk",)
        assert store.lookup([b, c]).tiers == ("host", "host")
        stats = store.stats()
        assert stats.blocks == {"host": 2, "disk": 1}
        assert stats.tiers["host"].evicted == 1 and stats.tiers["disk"].stored == 1
        dst = blank_cache(LAYOUT, 4)
        assert get(store, [a, b, c], dst, [3, 0, 2]) == 3
        assert store.stats().tiers["disk"].served == 1
        assert store.stats().tiers["host"].served == 2
    assert same_block(dst, 3, ref, 5) and same_block(dst, 0, ref, 6)
    assert same_block(dst, 2, ref, 7)


def test_demoted_block_on_disk_survives_restart(tmp_path, src):
    ref = src.numpy().copy()
    a, b = hashes_for(2)
    with KVStore(LAYOUT, [host(LAYOUT, 1), disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, [a], src, [2])
        put(store, [b], src, [3])  # a demoted
    with KVStore(LAYOUT, [host(LAYOUT, 1), disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.lookup([a]).tiers == ("disk",)
        dst = blank_cache(LAYOUT, 1)
        assert get(store, [a], dst, [0]) == 1
    assert same_block(dst, 0, ref, 2)


def test_last_tier_drops_its_least_recently_used_block(tmp_path, src):
    a, b, c, d = hashes_for(4)
    with KVStore(LAYOUT, [host(LAYOUT, 1), disk(tmp_path, LAYOUT, 2)]) as store:
        for i, h in enumerate([a, b, c, d]):
            put(store, [h], src, [i])
        # host: d; disk: a, b, c demoted in turn into 2 slots, so a (oldest) is dropped.
        assert store.lookup([d]).tiers == ("host",)
        assert store.lookup([b]).tiers == ("disk",) and store.lookup([c]).tiers == ("disk",)
        assert int(store.lookup([a])) == 0
        stats = store.stats()
        assert stats.tiers["host"].evicted == 3 and stats.tiers["disk"].evicted == 1
        assert stats.blocks == {"host": 1, "disk": 2}


def test_put_larger_than_host_keeps_whole_prefix_over_older_blocks(tmp_path, src):
    # Host 2 + disk 2 = 4 blocks; x and y are the least recently used. A 4-block put should
    # keep all 4 of its blocks (leading 2 in host, the rest on disk) and drop x and y.
    ref = src.numpy().copy()
    x, y = hashes_for(2, seed=1)
    hashes = hashes_for(4)
    with KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 2)]) as store:
        put(store, [x], src, [8])
        put(store, [y], src, [9])
        assert put(store, hashes, src, [0, 1, 2, 3]) == 4
        assert store.lookup(hashes).tiers == ("host", "host", "disk", "disk")
        dst = blank_cache(LAYOUT, 4)
        assert get(store, hashes, dst, [0, 1, 2, 3]) == 4
    for i in range(4):
        assert same_block(dst, i, ref, i)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capacity_is_never_exceeded(tmp_path, layout):
    src = random_cache(layout, 8)
    rng = np.random.default_rng(3)
    step = slot_nbytes(layout)
    with KVStore(layout, [host(layout, 3), disk(tmp_path, layout, 5)]) as store:
        for seed in range(60):
            n = int(rng.integers(1, 9))
            held = put(store, hashes_for(n, seed=seed, layout=layout), src,
                       rng.permutation(8)[:n])
            assert held <= n
            stats = store.stats()
            assert stats.capacity_blocks == {"host": 3, "disk": 5}
            assert stats.blocks["host"] <= 3 and stats.blocks["disk"] <= 5
            assert (tmp_path / "blocks.dat").stat().st_size == 5 * step
        assert store.stats().tiers["disk"].evicted > 0


# --- restart ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_blocks_survive_close_and_reopen(tmp_path, layout):
    src = random_cache(layout, 8)
    ref = src.numpy().copy()
    hashes = hashes_for(5, layout=layout)
    with KVStore(layout, [disk(tmp_path, layout, 8)], namespace="m@1") as store:
        assert put(store, hashes, src, [6, 1, 4, 0, 2]) == 5
    with KVStore(layout, [disk(tmp_path, layout, 8)], namespace="m@1") as store:
        assert store.lookup(hashes).tiers == ("disk",) * 5
        dst = blank_cache(layout, 8)
        assert get(store, hashes, dst, [0, 1, 2, 3, 4]) == 5
        assert store.stats().tiers["disk"].corrupt == 0
    for d, s in enumerate([6, 1, 4, 0, 2]):
        assert same_block(dst, d, ref, s)


def test_reopen_with_larger_capacity_keeps_blocks(tmp_path, src):
    ref = src.numpy().copy()
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 3)]) as store:
        put(store, hashes, src, [0, 1, 2])
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 6)]) as store:
        assert store.stats().capacity_blocks == {"disk": 6}
        dst = blank_cache(LAYOUT, 3)
        assert get(store, hashes, dst, [0, 1, 2]) == 3
    for i in range(3):
        assert same_block(dst, i, ref, i)


def test_restart_after_flush_and_evictions_serves_what_was_held(tmp_path, src):
    ref = src.numpy().copy()
    rng = np.random.default_rng(5)
    held: dict[int, int] = {}  # hash -> src block id
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        for seed in range(30):
            hashes = hashes_for(3, seed=seed)
            ids = [int(i) for i in rng.permutation(16)[:3]]
            put(store, hashes, src, ids)
            held.update(zip(hashes, ids))
        store.flush(WAIT)
        held = {h: i for h, i in held.items() if int(store.lookup([h]))}
    assert len(held) == 4
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.stats().blocks == {"disk": 4}
        for h, i in held.items():
            dst = blank_cache(LAYOUT, 1)
            assert get(store, [h], dst, [0]) == 1
            assert same_block(dst, 0, ref, i)


@pytest.mark.parametrize("disk_blocks", [1, 2, 3])
def test_restart_after_journal_compaction_keeps_every_held_block(tmp_path, src, disk_blocks):
    # Single-block puts into a full tiny tier append a drop and a put record each; past
    # 2 * entries + 4096 records the journal is rewritten (it shrinks). Close right after that
    # rewrite: every block held then must be held, byte-exact, after reopening.
    ref = src.numpy().copy()
    journal = tmp_path / "index.kvm"
    source: dict[int, int] = {}
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, disk_blocks)]) as store:
        size = journal.stat().st_size
        for n in range(6000):
            h = 10_000 + n
            source[h] = n % 16
            put(store, [h], src, [n % 16])
            new_size = journal.stat().st_size
            if new_size < size:
                break
            size = new_size
        else:
            pytest.fail("the journal was never compacted")
        held = [h for h in source if int(store.lookup([h]))]
    assert len(held) == disk_blocks
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, disk_blocks)]) as store:
        assert [h for h in held if int(store.lookup([h]))] == held
        dst = blank_cache(LAYOUT, disk_blocks)
        assert get(store, held, dst, range(len(held))) == len(held)
        for d, h in enumerate(held):
            assert same_block(dst, d, ref, source[h])


def test_restart_after_journal_compaction_keeps_working(tmp_path, src):
    ref = src.numpy().copy()
    journal = tmp_path / "index.kvm"
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        for n in range(2200):  # > 2 * 2 + 4096 records: compacted at least once
            put(store, [20_000 + n], src, [n % 16])
    # ~4400 records were appended; a journal never compacted would be bigger than this.
    assert journal.stat().st_size < 4096 * 32
    for rnd in range(2):  # reopen, keep putting, reopen again
        with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
            hashes = hashes_for(2, seed=50 + rnd)
            assert put(store, hashes, src, [3, 9]) == 2
            dst = blank_cache(LAYOUT, 2)
            assert get(store, hashes, dst, [0, 1]) == 2
            assert same_block(dst, 0, ref, 3) and same_block(dst, 1, ref, 9)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        assert int(store.lookup(hashes)) == 2


# --- corruption: a miss, never wrong data -------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flipped_byte_in_blocks_dat_is_a_miss_not_wrong_data(tmp_path, layout):
    src = random_cache(layout, 4)
    hashes = hashes_for(1, layout=layout)
    with KVStore(layout, [disk(tmp_path, layout, 4)]) as store:
        put(store, hashes, src, [2])
    slot = slot_holding(tmp_path, layout, block_bytes(src, 2))
    flip_byte(tmp_path / "blocks.dat", slot * slot_nbytes(layout) + layout.bytes_per_block - 1)
    with KVStore(layout, [disk(tmp_path, layout, 4)]) as store:
        assert int(store.lookup(hashes)) == 1  # the index still names it until it is read
        dst = blank_cache(layout, 2)
        assert get(store, hashes, dst, [1]) == 0
        assert untouched(dst, 1)
        stats = store.stats()
        assert stats.tiers["disk"].corrupt == 1 and stats.tiers["disk"].served == 0
        assert stats.blocks == {"disk": 0}
        assert store.lookup(hashes).decision == "miss"
        assert get(store, hashes, dst, [1]) == 0
        assert store.stats().tiers["disk"].corrupt == 1
    with KVStore(layout, [disk(tmp_path, layout, 4)]) as store:
        assert int(store.lookup(hashes)) == 0  # the drop was journaled


def host_slot(store: KVStore, block_hash: int) -> int:
    """The slot of the store's host tier (its first) that holds ``block_hash``."""
    return store._tiers[0].index[block_hash][0]


def flip_in_host_tier(store: KVStore, block_hash: int) -> None:
    raw = store._tiers[0].cache.numpy().view(np.uint8)  # (L, N, ...) bytes
    raw[1, host_slot(store, block_hash)].flat[5] ^= 0xFF  # layer 1: past the first layer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_flipped_byte_in_the_host_tier_is_a_miss_not_wrong_data(layout):
    """The host tier checksums every block it stores (XXH3 of every layer, as the disk tier):
    a byte flipped in its memory makes that block a miss, counted corrupt and dropped; the
    blocks before it are served, nothing of it reaches the cache."""
    src = random_cache(layout, 4)
    ref = src.numpy().copy()
    hashes = hashes_for(3, layout=layout)
    with KVStore(layout, [host(layout, 4)]) as store:
        put(store, hashes, src, [0, 1, 2])
        flip_in_host_tier(store, hashes[1])
        dst = blank_cache(layout, 3)
        assert get(store, hashes, dst, [0, 1, 2]) == 1
        assert same_block(dst, 0, ref, 0) and untouched(dst, 1) and untouched(dst, 2)
        stats = store.stats()
        assert stats.tiers["host"].corrupt == 1
        assert int(store.lookup(hashes)) == 1
        assert store.lookup(hashes[2:]).tiers == ("host",)  # the one after it is kept


def test_a_damaged_host_block_is_not_demoted_to_disk(tmp_path):
    """Eviction from the host tier checks each block before it goes down: the disk tier
    would checksum the damaged bytes afresh and serve them as intact."""
    src = random_cache(LAYOUT, 4)
    ref = src.numpy().copy()
    hashes = hashes_for(4)
    with KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 8)]) as store:
        put(store, hashes[:2], src, [0, 1])
        flip_in_host_tier(store, hashes[0])
        put(store, hashes[2:], src, [2, 3])  # evicts both host blocks to the disk
        stats = store.stats()
        assert stats.tiers["host"].corrupt == 1
        assert store.lookup(hashes[:1]).decision == "miss"
        assert store.lookup(hashes[1:2]).tiers == ("disk",)
        dst = blank_cache(LAYOUT, 1)
        assert get(store, hashes[1:2], dst, [0]) == 1 and same_block(dst, 0, ref, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corrupt_middle_block_returns_leading_intact_count(tmp_path, layout):
    src = random_cache(layout, 6)
    ref = src.numpy().copy()
    hashes = hashes_for(5, layout=layout)
    with KVStore(layout, [disk(tmp_path, layout, 8)]) as store:
        put(store, hashes, src, [0, 1, 2, 3, 4])
    slot = slot_holding(tmp_path, layout, block_bytes(src, 2))
    flip_byte(tmp_path / "blocks.dat", slot * slot_nbytes(layout) + 17)
    with KVStore(layout, [disk(tmp_path, layout, 8)]) as store:
        dst = blank_cache(layout, 6)
        assert get(store, hashes, dst, [5, 4, 3, 2, 1]) == 2
        assert same_block(dst, 5, ref, 0) and same_block(dst, 4, ref, 1)
        assert untouched(dst, 3)
        assert store.stats().tiers["disk"].corrupt == 1
        assert int(store.lookup(hashes)) == 2
        # The blocks after the dropped one are still stored and intact.
        assert store.lookup(hashes[3:]).tiers == ("disk", "disk")
        dst2 = blank_cache(layout, 2)
        assert get(store, hashes[3:], dst2, [0, 1]) == 2
    assert same_block(dst2, 0, ref, 3) and same_block(dst2, 1, ref, 4)


def test_get_in_another_order_than_stored_is_byte_exact(tmp_path, src):
    # Stored in consecutive slots, read back in reverse: one I/O chunk per block.
    ref = src.numpy().copy()
    hashes = hashes_for(6)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)]) as store:
        put(store, hashes, src, [10, 11, 12, 13, 14, 15])
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)]) as store:
        dst = blank_cache(LAYOUT, 6)
        assert get(store, hashes[::-1], dst, [0, 1, 2, 3, 4, 5]) == 6
    for d, s in enumerate([15, 14, 13, 12, 11, 10]):
        assert same_block(dst, d, ref, s)


def test_corrupt_block_in_a_later_chunk_of_a_scattered_get(tmp_path, src):
    ref = src.numpy().copy()
    hashes = hashes_for(6)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)]) as store:
        put(store, hashes, src, range(6))
    slot = slot_holding(tmp_path, LAYOUT, block_bytes(src, 1))
    flip_byte(tmp_path / "blocks.dat", slot * 4096 + 2048)
    order = [4, 2, 0, 1, 5, 3]  # non-consecutive slots; hashes[1] is the fourth read
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)]) as store:
        dst = blank_cache(LAYOUT, 6)
        assert get(store, [hashes[i] for i in order], dst, range(6)) == 3
        assert store.stats().tiers["disk"].corrupt == 1
    for d in range(3):
        assert same_block(dst, d, ref, order[d])
    assert untouched(dst, 3)


def test_put_and_get_spanning_several_staging_buffers(tmp_path):
    # 1 MiB blocks: a 16 MiB staging buffer moves 16 slots, so 36 blocks take 3 chunks each way.
    big = KVSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float32", block_size=64)
    assert big.bytes_per_block == 1 << 20
    src = random_cache(big, 36)
    ref = src.numpy().copy()
    hashes = hashes_for(36, layout=big)
    with KVStore(big, [disk(tmp_path, big, 36)]) as store:
        assert put(store, hashes, src, range(36)) == 36
    flip_byte(tmp_path / "blocks.dat", slot_holding(tmp_path, big, block_bytes(src, 20)) *
              (1 << 20) + 12345)
    with KVStore(big, [disk(tmp_path, big, 36)]) as store:
        dst = blank_cache(big, 36)
        assert get(store, hashes, dst, range(36)) == 20
        assert untouched(dst, 20)
        dst2 = blank_cache(big, 15)
        assert get(store, hashes[21:], dst2, range(15)) == 15
    for i in range(20):
        assert same_block(dst, i, ref, i)
    for i in range(15):
        assert same_block(dst2, i, ref, 21 + i)


def test_swapped_slots_are_misses_not_each_others_blocks(tmp_path, src):
    hashes = hashes_for(2)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        put(store, hashes, src, [4, 5])
    raw = bytearray((tmp_path / "blocks.dat").read_bytes())
    raw[0:4096], raw[4096:8192] = raw[4096:8192], raw[0:4096]
    (tmp_path / "blocks.dat").write_bytes(bytes(raw))
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        dst = blank_cache(LAYOUT, 2)
        assert get(store, hashes[:1], dst, [0]) == 0
        assert get(store, hashes[1:], dst, [1]) == 0
        assert untouched(dst, 0) and untouched(dst, 1)
        assert store.stats().tiers["disk"].corrupt == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_truncated_blocks_dat_is_a_miss(tmp_path, layout):
    src = random_cache(layout, 4)
    ref = src.numpy().copy()
    hashes = hashes_for(4, layout=layout)
    step = slot_nbytes(layout)
    with KVStore(layout, [disk(tmp_path, layout, 4)]) as store:
        put(store, hashes, src, [0, 1, 2, 3])
    slots = [slot_holding(tmp_path, layout, block_bytes(src, b)) for b in range(4)]
    assert slots == sorted(slots)  # one put on an empty tier: consecutive slots, in order
    cut = slots[2] * step + layout.bytes_per_block // 2  # mid-way through the third block
    os.truncate(tmp_path / "blocks.dat", cut)
    with KVStore(layout, [disk(tmp_path, layout, 4)]) as store:
        dst = blank_cache(layout, 4)
        assert get(store, hashes, dst, [3, 2, 1, 0]) == 2
        assert same_block(dst, 3, ref, 0) and same_block(dst, 2, ref, 1)
        assert untouched(dst, 1)
        assert store.stats().tiers["disk"].corrupt == 1
        assert int(store.lookup(hashes)) == 2


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _garbage_record(kind: str) -> bytes:
    if kind == "partial":  # a record cut off mid-append
        return struct.pack("<B3xIqQQ", 1, 0, 0, 123, 456)[:20]
    if kind == "bad_crc":  # a whole record with a wrong crc32
        return struct.pack("<B3xIqQQ", 1, 0xDEADBEEF, 3, 123, 456)
    return bytes(range(37))  # plain garbage


@pytest.mark.parametrize("kind", ["partial", "bad_crc", "garbage"])
def test_torn_journal_tail_reopens_and_serves_intact_blocks(tmp_path, src, kind):
    ref = src.numpy().copy()
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, [7, 8, 9])
    _append(tmp_path / "index.kvm", _garbage_record(kind))
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.stats().blocks == {"disk": 3}
        dst = blank_cache(LAYOUT, 3)
        assert get(store, hashes, dst, [0, 1, 2]) == 3
        # still writable after the torn tail was cut off
        more = hashes_for(1, seed=9)
        assert put(store, more, src, [1]) == 1
    for d, s in enumerate([7, 8, 9]):
        assert same_block(dst, d, ref, s)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        assert int(store.lookup(hashes + more)) == 4


def test_torn_last_journal_record_loses_only_its_block(tmp_path, src):
    ref = src.numpy().copy()
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, [0, 1, 2])
    journal = tmp_path / "index.kvm"
    os.truncate(journal, journal.stat().st_size - 5)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.lookup(hashes).tiers == ("disk", "disk")
        dst = blank_cache(LAYOUT, 3)
        assert get(store, hashes, dst, [0, 1, 2]) == 2
        assert untouched(dst, 2)
    assert same_block(dst, 0, ref, 0) and same_block(dst, 1, ref, 1)


# --- rejections: refused directories --------------------------------------------------------


@pytest.mark.parametrize("damage", ["magic", "version", "json", "empty"])
def test_journal_with_bad_header_is_refused(tmp_path, src, damage):
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        put(store, hashes_for(1), src, [0])
    journal = tmp_path / "index.kvm"
    data = bytearray(journal.read_bytes())
    if damage == "magic":
        data[0:8] = b"NOTINDEX"
    elif damage == "version":
        data[8:12] = struct.pack("<I", 99)
    elif damage == "json":
        data[16] = ord("#")
    else:
        data = bytearray()
    journal.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="index.kvm"):
        KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)])


def test_a_journal_of_xxh64_checksums_is_emptied_not_refused(tmp_path, src, caplog):
    """Version 1 journals recorded XXH64 checksums: their blocks would all read back as
    corrupt, so the store drops them (saying so) and reuses the directory."""
    hashes = hashes_for(2)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        put(store, hashes, src, [0, 1])
    journal = tmp_path / "index.kvm"
    data = bytearray(journal.read_bytes())
    data[8:12] = struct.pack("<I", 1)
    journal.write_bytes(bytes(data))
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        assert int(store.lookup(hashes)) == 0
        assert put(store, hashes, src, [0, 1]) == 2
    assert "older kvmove" in caplog.text
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        assert int(store.lookup(hashes)) == 2


def test_directory_of_another_layout_is_refused(tmp_path, src):
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]) as store:
        put(store, hashes_for(1), src, [0])
    other = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=16)
    with pytest.raises(StoreError, match="another layout"):
        KVStore(other, [DiskTier(str(tmp_path), 2 * 4096)])


def test_directory_of_another_namespace_is_refused(tmp_path, src):
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)], namespace="llama@a") as store:
        put(store, hashes_for(1), src, [0])
    with pytest.raises(StoreError, match="another layout"):
        KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)], namespace="llama@b")


@pytest.mark.parametrize("intruder", ["other_layout", "other_namespace"])
def test_refused_open_leaves_the_directory_intact(tmp_path, src, intruder):
    # The same capacity_bytes with ODD's larger slots, or another namespace with a smaller
    # capacity: the open must fail without touching the blocks already there.
    ref = src.numpy().copy()
    hashes = hashes_for(4)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, [0, 1, 2, 3])
    before = (tmp_path / "blocks.dat").read_bytes()
    with pytest.raises(StoreError):
        if intruder == "other_layout":
            KVStore(ODD, [DiskTier(str(tmp_path), 4 * 4096)])
        else:
            KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 1)], namespace="other")
    assert (tmp_path / "blocks.dat").read_bytes() == before
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        dst = blank_cache(LAYOUT, 4)
        assert get(store, hashes, dst, [0, 1, 2, 3]) == 4
    for i in range(4):
        assert same_block(dst, i, ref, i)


def test_second_store_on_open_directory_is_refused(tmp_path, src):
    ref = src.numpy().copy()
    hashes = hashes_for(2)
    first = KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)])
    try:
        put(first, hashes, src, [0, 1])
        with pytest.raises(StoreError, match="in use"):
            KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)])
        with pytest.raises(StoreError, match="in use"):  # behind a host tier too
            KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 4)])
        dst = blank_cache(LAYOUT, 2)  # the first store is unharmed
        assert get(first, hashes, dst, [0, 1]) == 2
        assert same_block(dst, 0, ref, 0) and same_block(dst, 1, ref, 1)
    finally:
        first.close()
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as second:
        assert int(second.lookup(hashes)) == 2


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreError, match="cannot use"):
        KVStore(LAYOUT, [DiskTier(str(tmp_path / "file"), 4096)])


# --- rejections: configuration ------------------------------------------------------------


@pytest.mark.parametrize("order", [[], ["disk", "host"], ["host", "host"], ["disk", "disk"]])
def test_bad_tier_lists_are_refused(tmp_path, order):
    make = {"host": lambda: host(LAYOUT, 2), "disk": lambda: disk(tmp_path, LAYOUT, 2)}
    with pytest.raises(ConfigError, match="tiers must be"):
        KVStore(LAYOUT, [make[k]() for k in order])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_capacity_under_one_block_is_refused(layout):
    with pytest.raises(ConfigError, match="HostTier capacity_bytes .* holds no block"):
        KVStore(layout, [HostTier(layout.bytes_per_block - 1)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disk_capacity_under_one_slot_is_refused(tmp_path, layout):
    # ODD: one block's bytes (9216) is less than one 12288 B slot.
    capacity = layout.bytes_per_block if layout is ODD else slot_nbytes(layout) - 1
    with pytest.raises(ConfigError, match="DiskTier capacity_bytes .* holds no block"):
        KVStore(layout, [DiskTier(str(tmp_path), capacity)])


@pytest.mark.parametrize("capacity", [0, -4096, 4096.0, True])
def test_tier_capacity_must_be_a_positive_int(tmp_path, capacity):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        HostTier(capacity)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskTier(str(tmp_path), capacity)


def test_disk_tier_path_must_be_non_empty():
    with pytest.raises(ConfigError, match="non-empty path"):
        DiskTier("", 4096)


@pytest.mark.parametrize("op", ["put", "get"])
def test_cache_of_another_layout_is_refused(op):
    other = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=32)
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        with pytest.raises(ConfigError, match="layout"):
            getattr(store, op)([1], KVCache(other, 2), [0])


@pytest.mark.parametrize("op", ["put", "get"])
def test_cache_without_layout_is_refused(op):
    raw = kvmove._C.KVCache(LAYOUT.num_layers, 2, LAYOUT.bytes_per_block_per_layer, False)
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        with pytest.raises(ConfigError, match="layout"):
            getattr(store, op)([1], raw, [0])


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize(("hashes", "ids"), [([1, 2], [0]), ([1], [0, 1]), ([], [0])])
def test_mismatched_hashes_and_ids_are_refused(src, op, hashes, ids):
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        with pytest.raises(ConfigError, match="one hash per block id"):
            getattr(store, op)(hashes, src, ids)


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("bad_id", [16, -1, 10**6])
def test_block_id_out_of_range_is_refused(src, op, bad_id):
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        with pytest.raises(ConfigError, match=f"block id {bad_id} is out of range"):
            getattr(store, op)([1, 2], src, [0, bad_id])


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("bad_hash", [-1, 2**64, 2**70])
def test_hash_out_of_range_is_refused(src, op, bad_hash):
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        with pytest.raises(ConfigError, match=r"hashes must be in \[0, 2\*\*64\)"):
            getattr(store, op)([1, bad_hash], src, [0, 1])


def test_refused_put_stores_nothing(src):
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        with pytest.raises(ConfigError):
            store.put([1, 2], src, [0, 99])
        assert store.stats().blocks == {"host": 0}
        assert int(store.lookup([1])) == 0


@pytest.mark.parametrize("timeout", [-1.0, -1e-9, math.nan])
def test_wait_with_bad_timeout_is_refused(src, timeout):
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        handle = store.put([1], src, [0])
        with pytest.raises(ConfigError, match="timeout"):
            handle.wait(timeout)
        assert handle.wait(WAIT) == 1


def test_wait_past_its_timeout_raises_timeout_error(src):
    with KVStore(LAYOUT, [host(LAYOUT, 2)]) as store:
        store._lock.acquire()  # stalls the I/O thread (white box: nothing public blocks it)
        try:
            handle = store.put([1], src, [0])
            with pytest.raises(TimeoutError, match="not done"):
                handle.wait(0.05)
            assert not handle.done()
        finally:
            store._lock.release()
        assert handle.wait(WAIT) == 1  # the operation went on


@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_put_and_get_after_close_are_refused(tmp_path, src, op, kind):
    store = KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path))
    store.close()
    with pytest.raises(StoreError, match="closed"):
        getattr(store, op)([1], src, [0])
    store.close()  # closing twice is harmless


# --- load or recompute --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_decision_is_load_before_any_measurement(tmp_path, src, kind):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path)) as store:
        put(store, hashes, src, [0, 1, 2])
        look = store.lookup(hashes)
        assert look.decision == "load"
        assert look.load_blocks == 3
        assert look.read_gbps == {kind: None}
        assert look.prefill_tokens_per_second is None
        assert look.recompute_seconds is None
        assert look.load_seconds is None
        assert store.stats().decisions["load"] == 1


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_decision_is_recompute_when_prefill_is_absurdly_fast(tmp_path, src, kind):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path)) as store:
        put(store, hashes, src, [0, 1, 2])
        assert get(store, hashes, blank_cache(LAYOUT, 3), [0, 1, 2]) == 3
        store.observe_prefill(10**15, 1.0)
        look = store.lookup(hashes)
        assert look.read_gbps[kind] is not None and look.read_gbps[kind] > 0
        assert look.prefill_tokens_per_second == pytest.approx(1e15)
        assert look.decision == "recompute"
        assert look.load_blocks == 0
        assert look.num_blocks == 3
        assert store.stats().decisions["recompute"] == 1


def test_load_policy_always_loads_what_auto_would_recompute(tmp_path, src):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [host(LAYOUT, 4)], load_policy="always") as store:
        put(store, hashes, src, [0, 1, 2])
        get(store, hashes, blank_cache(LAYOUT, 3), [0, 1, 2])
        store.observe_prefill(10**15, 1.0)
        look = store.lookup(hashes)
        assert (look.decision, look.load_blocks) == ("load", 3)
        assert look.recompute_seconds is not None and look.load_seconds is not None


def test_an_unknown_load_policy_is_refused():
    with pytest.raises(ConfigError, match="load_policy must be one of.*'never'"):
        KVStore(LAYOUT, [host(LAYOUT, 4)], load_policy="never")


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_decision_is_load_when_prefill_is_slow(tmp_path, src, kind):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, tiers_for(kind, LAYOUT, tmp_path)) as store:
        put(store, hashes, src, [0, 1, 2])
        get(store, hashes, blank_cache(LAYOUT, 3), [0, 1, 2])
        store.observe_prefill(1, 1.0)  # 1 token/s
        look = store.lookup(hashes)
        assert look.decision == "load"
        assert look.load_blocks == 3
        assert look.recompute_seconds == pytest.approx(3 * LAYOUT.block_size)
        assert look.load_seconds is not None and look.load_seconds >= 0
        assert store.stats().prefill_tokens_per_second == pytest.approx(1.0)


def test_decision_with_prefill_but_no_read_measured_is_load(src):
    hashes = hashes_for(2)
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        put(store, hashes, src, [0, 1])
        store.observe_prefill(10**15, 1.0)
        look = store.lookup(hashes)
        assert look.decision == "load" and look.load_blocks == 2


def test_observe_prefill_ignores_non_positive_input(src):
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        store.observe_prefill(0, 1.0)
        store.observe_prefill(100, 0.0)
        store.observe_prefill(-5, 1.0)
        assert store.stats().prefill_tokens_per_second is None
        store.observe_prefill(100, 2.0)
        assert store.stats().prefill_tokens_per_second == pytest.approx(50.0)


def test_lookup_of_nothing_stored_is_a_counted_miss(src):
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        put(store, hashes_for(1, seed=7), src, [0])
        look = store.lookup(hashes_for(4))
        assert look.decision == "miss"
        assert look.tiers == () and look.num_blocks == 0 and int(look) == 0
        assert look.load_blocks == 0
        stats = store.stats()
        assert stats.lookups == 1
        assert stats.lookup_misses == 4
        assert stats.decisions == {"load": 0, "partial": 0, "recompute": 0, "miss": 1}
        assert stats.tiers["host"].hits == 0


def test_partial_lookup_counts_misses_after_the_stored_prefix(src):
    hashes = hashes_for(5)
    with KVStore(LAYOUT, [host(LAYOUT, 8)]) as store:
        put(store, hashes[:2], src, [0, 1])
        look = store.lookup(hashes)
        assert look.num_blocks == 2 and look.decision == "load"
        assert store.stats().lookup_misses == 3
        assert store.stats().tiers["host"].hits == 2


@pytest.mark.parametrize(("tiers", "load_blocks", "decision"), [
    ((), 0, "miss"),
    (("host", "disk"), 2, "load"),
    (("host", "disk"), 1, "partial"),
    (("host", "disk"), 0, "recompute"),
])
def test_lookup_decision_names(tiers, load_blocks, decision):
    look = Lookup(tiers, load_blocks, None, None, {}, None)
    assert look.decision == decision
    assert int(look) == look.num_blocks == len(tiers)
    assert [0, 1, 2][look] == len(tiers)  # __index__


# --- stats --------------------------------------------------------------------------------


def test_host_stats_count_hits_served_stored_evicted_and_bytes(src):
    hashes = hashes_for(5)
    bpb = LAYOUT.bytes_per_block
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        put(store, hashes[:3], src, [0, 1, 2])
        s = store.stats().tiers["host"]
        assert (s.stored, s.bytes_written, s.evicted, s.hits, s.served) == (3, 3 * bpb, 0, 0, 0)
        assert s.write_gbps is not None and s.read_gbps is None
        store.lookup(hashes[:3])
        assert store.stats().tiers["host"].hits == 3
        get(store, hashes[:2], blank_cache(LAYOUT, 2), [0, 1])
        s = store.stats().tiers["host"]
        assert (s.served, s.bytes_read, s.corrupt) == (2, 2 * bpb, 0)
        assert s.read_gbps is not None
        put(store, hashes[3:], src, [3, 4])  # 5 > 4: one evicted
        stats = store.stats()
        s = stats.tiers["host"]
        assert (s.stored, s.bytes_written, s.evicted, s.write_errors) == (5, 5 * bpb, 1, 0)
        assert stats.blocks == {"host": 4} and stats.capacity_blocks == {"host": 4}
        assert stats.as_dict()["tiers"]["host"]["stored"] == 5


def test_disk_stats_count_block_bytes_not_slot_bytes(tmp_path):
    src = random_cache(ODD, 4)
    hashes = hashes_for(3, layout=ODD)
    with KVStore(ODD, [disk(tmp_path, ODD, 4)]) as store:
        put(store, hashes, src, [0, 1, 2])
        get(store, hashes, blank_cache(ODD, 3), [0, 1, 2])
        s = store.stats().tiers["disk"]
        assert s.stored == 3 and s.bytes_written == 3 * ODD.bytes_per_block
        assert s.served == 3 and s.bytes_read == 3 * ODD.bytes_per_block
        assert s.read_gbps is not None and s.write_gbps is not None


def test_hits_go_to_the_fastest_tier_holding_a_block(tmp_path, src):
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [host(LAYOUT, 1), disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, [0, 1, 2])  # 1 in host, 2 straight to disk
        assert store.lookup(hashes).tiers == ("host", "disk", "disk")
        stats = store.stats()
        assert stats.tiers["host"].hits == 1 and stats.tiers["disk"].hits == 2
        assert stats.tiers["host"].stored == 1 and stats.tiers["disk"].stored == 2
        assert stats.blocks == {"host": 1, "disk": 2}


def test_repr_names_tiers(tmp_path, src):
    with KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 3)]) as store:
        put(store, hashes_for(1), src, [0])
        assert "host: 1/2 blocks" in repr(store) and "disk: 0/3 blocks" in repr(store)
        assert store.tier_names == ["host", "disk"]


# --- threads ------------------------------------------------------------------------------


def test_concurrent_puts_and_gets_from_threads_are_byte_exact(tmp_path):
    num_threads, ops, prompt = 4, 50, 6
    errors: list[BaseException] = []
    served = [0] * num_threads
    store = KVStore(LAYOUT, [host(LAYOUT, 8), disk(tmp_path, LAYOUT, 12)])

    def worker(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            src = random_cache(LAYOUT, prompt, seed=100 + t)
            ref = src.numpy().copy()
            prompts = [hashes_for(prompt, seed=1000 * (t + 1) + p) for p in range(4)]
            dst = KVCache(LAYOUT, prompt)
            for op in range(ops):
                hashes = prompts[int(rng.integers(len(prompts)))]
                n = int(rng.integers(1, prompt + 1))
                if op % 2 == 0:
                    assert put(store, hashes[:n], src, range(n)) <= n
                else:
                    dst.numpy()[...] = SENTINEL
                    ids = [int(i) for i in rng.permutation(prompt)[:n]]
                    got = get(store, hashes[:n], dst, ids)
                    assert 0 <= got <= n
                    for k in range(got):
                        assert same_block(dst, ids[k], ref, k)
                    if got < n:
                        assert untouched(dst, ids[got])
                    served[t] += got
                store.lookup(hashes)
                store.stats()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    try:
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads)
        stats = store.stats()
        assert stats.blocks["host"] <= 8 and stats.blocks["disk"] <= 12
        assert sum(served) > 0
        assert sum(s.served for s in stats.tiers.values()) == sum(served)
    finally:
        store.close()


# --- a full disk --------------------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (room for about 15 pages), unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"cannot mount a tmpfs: {error}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    yield mnt
    gc.collect()  # drop any BlockFile still holding blocks.dat open
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_put_reports_fewer_blocks_without_raising(tiny_fs, src):
    ref = src.numpy().copy()
    stored: dict[int, int] = {}
    results = []
    with KVStore(LAYOUT, [DiskTier(str(tiny_fs), 64 * 4096)]) as store:
        for n in range(24):  # 24 blocks of 4 KiB cannot fit in 64 KiB
            h = 5_000 + n
            results.append(put(store, [h], src, [n % 16]))
            stored[h] = n % 16
        assert 0 in results
        stats = store.stats()
        assert stats.tiers["disk"].write_errors >= 1
        assert 0 < stats.blocks["disk"] < 24
        held = [h for h in stored if int(store.lookup([h]))]
        assert len(held) == stats.blocks["disk"]
        dst = blank_cache(LAYOUT, len(held))
        assert get(store, held, dst, range(len(held))) == len(held)
        for d, h in enumerate(held):
            assert same_block(dst, d, ref, stored[h])


def test_full_disk_keeps_taking_puts_without_raising(tiny_fs, src):
    # Once full, the tier reuses evicted slots; every put appends to the journal, which must
    # not turn a full disk into an exception either.
    ref = src.numpy().copy()
    with KVStore(LAYOUT, [DiskTier(str(tiny_fs), 64 * 4096)]) as store:
        for n in range(300):
            assert put(store, [7_000 + n], src, [n % 16]) in (0, 1)
        assert store.stats().tiers["disk"].write_errors >= 1
        last = 7_000 + 299
        assert int(store.lookup([last])) == 1  # slots freed by eviction are reused
        dst = blank_cache(LAYOUT, 1)
        assert get(store, [last], dst, [0]) == 1
        assert same_block(dst, 0, ref, 299 % 16)


def test_full_disk_after_an_oversized_put_still_stores_blocks(tiny_fs, src):
    # One 32-block put overflows the 64 KiB file system part-way; afterwards the tier must
    # still be able to hold blocks (the file system has room for about a dozen).
    ref = src.numpy().copy()
    with KVStore(LAYOUT, [DiskTier(str(tiny_fs), 64 * 4096)]) as store:
        first = put(store, range(1, 33), src, [i % 16 for i in range(32)])
        assert first < 32
        assert store.stats().tiers["disk"].write_errors >= 1
        later = [put(store, [100 + n], src, [n]) for n in range(4)]
        assert sum(later) > 0, f"the full tier stores nothing any more: {later}"
        h = next(100 + n for n in range(4) if later[n])
        dst = blank_cache(LAYOUT, 1)
        assert get(store, [h], dst, [0]) == 1
        assert same_block(dst, 0, ref, h - 100)
