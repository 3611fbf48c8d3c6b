"""Assertions the tests share: an error names the values it is about, and a blocking call
returns in time (a hung call fails its test instead of hanging the run)."""

from __future__ import annotations

import ipaddress
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

# Child Pythons run from a neutral directory: from the repository root (where `pytest` runs),
# `python -c` and `python -m` put the source tree first on sys.path and import its kvmove (no
# compiled core in a non-editable install) instead of the installed one.
WORKDIR = tempfile.gettempdir()
POLL_SECONDS = 0.05


def names(excinfo: pytest.ExceptionInfo, *values: object) -> None:
    """The exception's message contains each of ``values`` (as ``str``)."""
    message = str(excinfo.value)
    for v in values:
        assert str(v) in message, f"{v!r} not named in {message!r}"


def within(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread: its result or exception, or a test failure
    (instead of a hung test) if it has not returned after ``seconds``."""
    return Background(fn, *args, **kwargs).join(seconds).get()


class Background:
    """A blocking call running in a daemon thread; records its outcome and when it ended."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self._name = getattr(fn, "__name__", repr(fn))
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self.value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported by get()
            self.error = e
        finally:
            self.ended_at = time.monotonic()

    def pending(self) -> bool:
        return self.thread.is_alive()

    def join(self, seconds: float) -> Background:
        self.thread.join(seconds)
        assert not self.thread.is_alive(), f"{self._name} still blocked after {seconds} s"
        return self

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def listening_addresses(pid: int | None = None) -> set[tuple[str, int]]:
    """``(address, port)`` of each TCP socket process ``pid`` (default: this one) listens on,
    read from /proc: ("127.0.0.1", 5555), ("0.0.0.0", 41000), ("::", 80)..."""
    pid = pid or os.getpid()
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order.
                words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
                found.add((str(ipaddress.ip_address(b"".join(words))), int(port, 16)))
    return found


def wait_until(predicate: Callable[[], bool], seconds: float,
               what: str | Callable[[], str]) -> None:
    """Polls ``predicate`` until it holds; fails saying ``what`` (or what it returns, then)
    after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            message = what if isinstance(what, str) else what()
            raise AssertionError(f"not after {seconds:g} s: {message}")
        time.sleep(POLL_SECONDS)


def wait_while_rising(count: Callable[[], int], target: int, stall_seconds: float,
                      most_seconds: float = 120.0) -> None:
    """Waits until ``count()`` reaches ``target``; fails once it has not risen for
    ``stall_seconds`` (or after ``most_seconds`` in all): for a backlog whose size the test
    does not control, drained at a pace the machine sets."""
    start = time.monotonic()
    last, rose = count(), start
    while last < target:
        time.sleep(POLL_SECONDS)
        now, seen = time.monotonic(), count()
        if seen > last:
            last, rose = seen, now
        elif now - rose > stall_seconds or now - start > most_seconds:
            raise AssertionError(f"{last} of {target} after {now - start:.1f} s, "
                                 f"none more in the last {now - rose:.1f} s")
