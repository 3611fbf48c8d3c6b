"""What a caller without the store needs (vLLM's scheduler: the store lives in its worker):
``KVStore.take_changes`` to mirror the store's index, ``decide_load`` to decide as
``KVStore.lookup`` does from reported measurements. The mirror must equal the store's own
answer after every kind of change: put, demotion to disk, eviction, corruption, reopening.
"""

from __future__ import annotations

import pytest
from test_store import LAYOUT, blank_cache, disk, get, hashes_for, host, put, random_cache

from kvmove import KVStore
from kvmove.store import decide_load


def mirror_matches(store: KVStore, mirror: dict[int, str], hashes: list[int]) -> bool:
    for h, tier in store.take_changes().items():
        if tier is None:
            mirror.pop(h, None)
        else:
            mirror[h] = tier
    held = {h: t for h, t in zip(hashes, _tiers_of(store, hashes)) if t is not None}
    return mirror == held


def _tiers_of(store: KVStore, hashes: list[int]) -> list[str | None]:
    out = []
    for h in hashes:   # one lookup per hash: a lookup stops at the first miss
        tiers = store.lookup([h]).tiers
        out.append(tiers[0] if tiers else None)
    return out


def test_take_changes_mirrors_puts_demotions_and_evictions(tmp_path):
    src = random_cache(LAYOUT, 16)
    hashes = hashes_for(12)
    mirror: dict[int, str] = {}
    with KVStore(LAYOUT, [host(LAYOUT, 2), disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.take_changes() == {}
        put(store, hashes[:3], src, range(3))       # 2 to host, 1 to disk
        assert mirror_matches(store, mirror, hashes)
        assert sorted(mirror.values()) == ["disk", "host", "host"]
        put(store, hashes[3:9], src, range(3, 9))   # demotes to disk, drops from disk
        assert mirror_matches(store, mirror, hashes)
        assert len(mirror) == 6
        assert store.take_changes() == {}           # nothing new since


def test_take_changes_reports_a_corrupt_block_dropped(tmp_path):
    src = random_cache(LAYOUT, 4)
    hashes = hashes_for(2)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, [0, 1])
        assert set(store.take_changes().values()) == {"disk"}
        with open(tmp_path / "blocks.dat", "r+b") as f:
            f.write(b"\xff" * 64)                   # damages one of the two slots
        assert get(store, hashes, blank_cache(LAYOUT, 2), [0, 1]) < 2
        changes = store.take_changes()
        assert list(changes.values()) == [None] and next(iter(changes)) in hashes


def test_reopened_disk_tier_reports_what_it_holds(tmp_path):
    src = random_cache(LAYOUT, 4)
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        put(store, hashes, src, range(3))
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 4)]) as store:
        assert store.take_changes() == {h: "disk" for h in hashes}


@pytest.mark.parametrize("tps", [None, 1.0, 1e15])
def test_decide_load_equals_the_stores_lookup(tps):
    src = random_cache(LAYOUT, 4)
    hashes = hashes_for(3)
    with KVStore(LAYOUT, [host(LAYOUT, 4)]) as store:
        put(store, hashes, src, range(3))
        get(store, hashes, blank_cache(LAYOUT, 3), range(3))
        if tps is not None:
            store.observe_prefill(int(tps), 1.0)
        look = store.lookup(hashes)
        read = {"host": store.stats().tiers["host"].read_gbps}
        assert decide_load(look.tiers, read, look.prefill_tokens_per_second, LAYOUT) == look


def test_decide_load_with_nothing_stored_is_a_miss():
    found = decide_load((), {}, 1000.0, LAYOUT)
    assert (found.decision, found.load_blocks) == ("miss", 0)
