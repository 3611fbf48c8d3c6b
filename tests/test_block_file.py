"""BlockFile (csrc/storage/block_file.h), the disk tier's bytes, read with many requests in
flight: whatever the order the reads complete in, the blocks arrive byte-exact, and a block
whose checksum fails ends the prefix that counts, is never written, and is reported at its
own position. Compared against the source cache (numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmove import KVCache, KVSpec
from kvmove._C import BlockFile
from kvmove.errors import StoreError

# 2 layers x 16 tokens x 2 (K, V) x 2 heads x 8 dims x 4 B = 4096 B: one slot per block, so a
# 2 MiB read request holds 512 of them.
SMALL = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
# 2 x 64 x 2 x 8 x 128 x 4 B = 1 MiB: two blocks per read request.
BIG = KVSpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float32", block_size=64)
SENTINEL = -7.0


def random_cache(layout: KVSpec, num_blocks: int) -> KVCache:
    cache = KVCache(layout, num_blocks)
    cache.numpy()[...] = np.random.default_rng(0).random(cache.shape, dtype=np.float32)
    return cache


def blank_cache(layout: KVSpec, num_blocks: int) -> KVCache:
    cache = KVCache(layout, num_blocks)
    cache.numpy()[...] = SENTINEL
    return cache


def stored(tmp_path, layout: KVSpec, num_blocks: int, slots: list[int]):
    """A block file holding block i of a random cache in slots[i]: (file, source, checksums)."""
    src = random_cache(layout, num_blocks)
    file = BlockFile(str(tmp_path / "blocks.dat"), layout.bytes_per_block, max(slots) + 1)
    checksums = file.write(src._core, list(range(num_blocks)), slots, hashes(num_blocks))
    return file, src, checksums


def hashes(n: int) -> list[int]:
    return [(i + 1) * 0x9E3779B97F4A7C15 % 2**64 for i in range(n)]


def flip_byte(file: BlockFile, slot: int, offset: int) -> None:
    with open(file.path, "r+b") as f:
        f.seek(slot * file.slot_nbytes + offset)
        b = f.read(1)
        f.seek(slot * file.slot_nbytes + offset)
        f.write(bytes([b[0] ^ 0xFF]))


def assert_blocks(dst: KVCache, dst_ids, src: KVCache, src_ids) -> None:
    for d, s in zip(dst_ids, src_ids):
        np.testing.assert_array_equal(dst.numpy()[:, d], src.numpy()[:, s], f"block {d}")


def untouched(cache: KVCache, block_id: int) -> bool:
    return bool((cache.numpy()[:, block_id] == SENTINEL).all())


@pytest.mark.parametrize("layout, num_blocks, order", [
    pytest.param(SMALL, 300, "shuffled", id="300-single-slot-requests"),
    pytest.param(SMALL, 1500, "consecutive", id="3-requests-of-512-slots"),
    pytest.param(BIG, 40, "consecutive", id="20-requests-of-2-slots"),
    pytest.param(BIG, 40, "shuffled", id="40-requests-of-1-MiB"),
])
def test_many_blocks_read_at_once_are_byte_exact(tmp_path, layout, num_blocks, order):
    # More requests than read buffers: every buffer is reused while others are in flight.
    slots = list(range(num_blocks))
    if order == "shuffled":
        np.random.default_rng(1).shuffle(slots)
    file, src, checksums = stored(tmp_path, layout, num_blocks, slots)
    dst = blank_cache(layout, num_blocks)
    dst_ids = list(reversed(range(num_blocks)))  # another placement than the source's
    ok = file.read(dst._core, dst_ids, slots, hashes(num_blocks), checksums)
    assert ok == [1] * num_blocks
    assert_blocks(dst, dst_ids, src, range(num_blocks))


@pytest.mark.parametrize("bad", [0, 1, 137, 299])
def test_a_corrupt_block_ends_the_prefix_at_its_own_position(tmp_path, bad):
    slots = list(range(300))
    np.random.default_rng(2).shuffle(slots)  # one request per block, all in flight at once
    file, src, checksums = stored(tmp_path, SMALL, 300, slots)
    flip_byte(file, slots[bad], 1000)
    dst = blank_cache(SMALL, 300)
    ok = file.read(dst._core, list(range(300)), slots, hashes(300), checksums)
    assert ok == [1] * bad + [0] * (300 - bad)
    assert untouched(dst, bad)
    assert_blocks(dst, range(bad), src, range(bad))


def test_several_corrupt_blocks_each_fail_where_they_are(tmp_path):
    file, src, checksums = stored(tmp_path, BIG, 40, list(range(40)))
    for bad in (7, 8, 30):
        flip_byte(file, bad, 4096 * bad)
    expected = {0: 7, 9: 21, 31: 9}  # first block read -> how many arrive
    for first, count in expected.items():
        dst = blank_cache(BIG, 40)
        ids = list(range(first, 40))
        ok = file.read(dst._core, ids, ids, hashes(40)[first:], checksums[first:])
        assert ok == [1] * count + [0] * (len(ids) - count)
        assert_blocks(dst, ids[:count], src, ids[:count])
        if count < len(ids):
            assert untouched(dst, ids[count])


def test_a_wrong_checksum_fails_only_from_its_block(tmp_path):
    file, src, checksums = stored(tmp_path, SMALL, 600, list(range(600)))
    checksums[555] ^= 1
    dst = blank_cache(SMALL, 600)
    ok = file.read(dst._core, list(range(600)), list(range(600)), hashes(600), checksums)
    assert ok == [1] * 555 + [0] * 45
    assert untouched(dst, 555)
    assert_blocks(dst, range(555), src, range(555))


def test_a_block_named_twice_gets_the_later_slot(tmp_path):
    # Two slots into one block: copied in order, the later one wins (as a single reader would).
    file, src, checksums = stored(tmp_path, BIG, 6, list(range(6)))
    dst = blank_cache(BIG, 6)
    ok = file.read(dst._core, [0, 1, 0, 2], [0, 1, 4, 2], [hashes(6)[i] for i in (0, 1, 4, 2)],
                   [checksums[i] for i in (0, 1, 4, 2)])
    assert ok == [1, 1, 1, 1]
    assert_blocks(dst, [0, 1, 2], src, [4, 1, 2])


def test_slots_past_the_end_of_a_truncated_file_are_misses(tmp_path):
    file, src, checksums = stored(tmp_path, BIG, 12, list(range(12)))
    with open(file.path, "r+b") as f:
        f.truncate(5 * file.slot_nbytes + 100)  # slot 5 cut short, 6.. gone
    dst = blank_cache(BIG, 12)
    ok = file.read(dst._core, list(range(12)), list(range(12)), hashes(12), checksums)
    assert ok == [1] * 5 + [0] * 7
    assert untouched(dst, 5)


def test_read_after_close_is_refused(tmp_path):
    file, _, checksums = stored(tmp_path, SMALL, 4, list(range(4)))
    file.close()
    with pytest.raises(StoreError, match="closed"):
        file.read(blank_cache(SMALL, 4)._core, [0], [0], hashes(1), checksums[:1])
