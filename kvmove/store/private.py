"""Folders and files only the serving user can read: where a disk tier keeps its blocks.

Stored KV gives its prompt away (a tester decoded a 78-byte secret prompt exactly from the
layer-0 V values of a tier another user could read), so a tier's folder is 0700 and its files
0600, whatever the process umask. A mode is set explicitly after each creation (the umask can
only narrow the mode ``mkdir``/``open`` are given, never widen it, but we do not rely on the
caller's umask being sane either way). Something that already exists is checked: ours but
readable by others (a tier written before this rule, or by hand) is tightened; another user's
is refused with ``StoreError``, since its owner can read or swap what we write there.

Host tiers need none of this: their blocks live in anonymous memory (a ``memfd`` per
``KVCache``), reachable from another process only through ``/proc/<pid>/fd``, which the
kernel opens to the same user (and root) alone.
"""

from __future__ import annotations

import logging
import os
import stat

from kvmove.errors import StoreError

__all__ = ["FILE_MODE", "FOLDER_MODE", "open_private", "private_folder"]

logger = logging.getLogger(__name__)

FOLDER_MODE = 0o700
FILE_MODE = 0o600


def private_folder(path: str) -> None:
    """Makes ``path`` (and any missing parent, each 0700) a folder only this user can read.

    Raises:
        StoreError: ``path`` belongs to another user, is not a folder, or cannot be made.
    """
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, FOLDER_MODE)
            os.chmod(folder, FOLDER_MODE)
        except FileExistsError:  # another process made it meanwhile: checked below if ours
            pass
        except OSError as error:
            raise StoreError(f"cannot create the disk tier folder {folder!r}: "
                             f"{error.strerror}") from None
    _check_folder(path)


def _check_folder(path: str) -> None:
    try:
        info = os.stat(path)
    except OSError as error:
        raise StoreError(f"cannot use {path!r} as a disk tier: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StoreError(f"cannot use {path!r} as a disk tier: not a folder")
    _check_owner(path, info, "folder")
    if info.st_mode & 0o077:
        logger.warning("disk tier folder %s was mode %o: readable by others, now %o", path,
                       stat.S_IMODE(info.st_mode), FOLDER_MODE)
        try:
            os.chmod(path, FOLDER_MODE)
        except OSError as error:
            raise StoreError(f"disk tier folder {path!r} is mode "
                             f"{stat.S_IMODE(info.st_mode):o} (readable by others) and cannot "
                             f"be made {FOLDER_MODE:o}: {error.strerror}") from None


def open_private(path: str, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` for a file only this user can read (0600); an
    existing file of ours readable by others is tightened first. Returns the descriptor.

    Raises:
        OSError: the file cannot be opened.
        StoreError: the file belongs to another user.
    """
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        info = os.fstat(fd)
        _check_owner(path, info, "file")
        if stat.S_IMODE(info.st_mode) != FILE_MODE:
            if info.st_mode & 0o077:
                logger.warning("disk tier file %s was mode %o: readable by others, now %o",
                               path, stat.S_IMODE(info.st_mode), FILE_MODE)
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner(path: str, info: os.stat_result, what: str) -> None:
    """Refuses what another user owns: they can read it, or swap its contents, whatever its
    mode says now."""
    if info.st_uid != os.geteuid():
        raise StoreError(f"disk tier {what} {path!r} (mode {stat.S_IMODE(info.st_mode):o}) "
                         f"belongs to uid {info.st_uid}, not this process's uid "
                         f"{os.geteuid()}: its owner could read the stored KV; use a "
                         f"{what} of this user's")
