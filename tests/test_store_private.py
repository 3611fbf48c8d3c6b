"""A disk tier's folder and files only the serving user can read (``kvmove/store/private.py``).

Issue 28, row 6: a tier made under the usual umask was 0755 with 0644 files, and another user
decoded a 78-byte secret prompt exactly from its layer-0 V values. Each case runs under umask
0 (the worst a process can have), real files on the test's temporary directory: every folder
the tier makes is 0700 and every file 0600; an old tier readable by others is tightened and
still serves its blocks; another user's folder or file is refused.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from test_store import LAYOUT, blank_cache, disk, get, hashes_for, put, random_cache, same_block

from kvmove import KVStore
from kvmove.errors import StoreError

FILES = ("lock", "index.kvm", "blocks.dat")
NOBODY = 65534


@pytest.fixture(autouse=True)
def umask_0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def modes(folder: Path) -> dict[str, int]:
    return {name: mode(folder / name) for name in (".", *FILES)}


def fill(folder: Path, src=None, **kw) -> list[int]:
    """A store in ``folder`` holding the 4 blocks of ``src``; their hashes."""
    src = random_cache(LAYOUT, 4) if src is None else src
    hashes = hashes_for(4)
    with KVStore(LAYOUT, [disk(folder, LAYOUT, 8)], **kw) as store:
        assert put(store, hashes, src, [0, 1, 2, 3]) == 4
    return hashes


def test_a_new_tier_and_the_parents_it_makes_are_0700_its_files_0600(tmp_path):
    folder = tmp_path / "made" / "by" / "the-tier"
    before = mode(tmp_path)
    fill(folder)
    assert modes(folder) == {".": 0o700, "lock": 0o600, "index.kvm": 0o600, "blocks.dat": 0o600}
    assert mode(tmp_path / "made") == mode(tmp_path / "made" / "by") == 0o700
    assert mode(tmp_path) == before  # there already: not the tier's to change


def test_a_rewritten_index_stays_0600(tmp_path):
    """The journal is rewritten (a temporary file renamed over it) when a smaller capacity
    drops entries and when other weights empty it: the new file is 0600 too."""
    fill(tmp_path)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)]):
        assert mode(tmp_path / "index.kvm") == 0o600
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 2)], weights="other"):
        assert mode(tmp_path / "index.kvm") == 0o600
    assert not (tmp_path / "index.kvm.tmp").exists()


def test_an_old_tier_readable_by_others_is_tightened_and_still_served(tmp_path):
    src = random_cache(LAYOUT, 4)
    hashes = fill(tmp_path, src)
    tmp_path.chmod(0o755)  # what the tier was before: 0755, files 0644
    for name in FILES:
        (tmp_path / name).chmod(0o644)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)]) as store:
        assert modes(tmp_path) == {".": 0o700, "lock": 0o600, "index.kvm": 0o600,
                                   "blocks.dat": 0o600}
        dst = blank_cache(LAYOUT, 4)
        assert get(store, hashes, dst, [0, 1, 2, 3]) == 4
    ref = src.numpy()
    assert all(same_block(dst, i, ref, i) for i in range(4))


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user "
                                "needs root")


@needs_root
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(0o755)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(StoreError, match=f"{re.escape(str(folder))}.*mode 755.*uid {NOBODY}"):
        KVStore(LAYOUT, [disk(folder, LAYOUT, 8)])
    assert list(folder.iterdir()) == []  # nothing written into it


@needs_root
@pytest.mark.parametrize("name", FILES)
def test_a_file_of_another_user_is_refused(tmp_path, name):
    fill(tmp_path)
    os.chown(tmp_path / name, NOBODY, NOBODY)
    with pytest.raises(StoreError, match=f"{re.escape(str(tmp_path / name))}.*uid {NOBODY}"):
        KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)])


def test_a_file_where_the_folder_should_be_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StoreError, match="not a folder"):
        KVStore(LAYOUT, [disk(tmp_path / "file", LAYOUT, 8)])
