"""Network namespaces as hosts, for the tests that need more than one: ``Hosts`` makes
namespaces and joins pairs of them (or one with this test's own namespace) by veth pairs, each
pair a /24 of its own, and deletes all of it on ``destroy``.

Needs root and iproute2; ``hosts(build)`` skips the calling test, saying why, where either is
missing or the kernel refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
ROOT = ""  # this test's own namespace, as an end of a link


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10,
                          check=check)


class Hosts:
    """Namespaces ``kvm-NAME-PID``; link ``k`` is 10.(231+k).S.1/24 at its first end and
    .2 at its second (S from this process's id, so that two test runs do not collide)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.namespaces: list[str] = []
        self.devices: list[str] = []  # the first end of each link (deleting it deletes both)

    def add(self, name: str) -> str:
        """A new namespace with its loopback up; returns its name (for ``ip netns exec``)."""
        ns = f"kvm-{name}-{self.pid}"
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a: str, b: str) -> tuple[str, str, str, str]:
        """A veth pair from namespace ``a`` to ``b`` (``ROOT``: this one), up and addressed;
        returns (a's address, b's address, a's device, b's device)."""
        k = len(self.devices)
        dev_a, dev_b = f"kv{k}a{self.pid}", f"kv{k}b{self.pid}"  # < 16 chars for any pid
        subnet = self.pid % 250 + 1
        addr_a, addr_b = f"10.{231 + k}.{subnet}.1", f"10.{231 + k}.{subnet}.2"
        ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        self.devices.append(dev_a)
        for ns, dev, addr in ((a, dev_a, addr_a), (b, dev_b, addr_b)):
            where = ("-n", ns) if ns else ()
            if ns:
                ip("link", "set", dev, "netns", ns)
            ip(*where, "addr", "add", f"{addr}/24", "dev", dev)
            ip(*where, "link", "set", dev, "up")
        return addr_a, addr_b, dev_a, dev_b

    def rx_bytes(self, ns: str, dev: str) -> int:
        """Bytes ``dev`` in ``ns`` has received."""
        out = ip("-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def destroy(self) -> None:
        # Deleting a namespace deletes the veth ends inside it (and so the pairs); the link
        # deletes cover the root's ends and a failure between creating a pair and moving it.
        for dev in self.devices:
            ip("link", "del", dev, check=False)
        for ns in self.namespaces:
            ip("netns", "del", ns, check=False)
        leftover = ip("netns", "list").stdout
        assert not any(ns in leftover for ns in self.namespaces), leftover


@contextmanager
def hosts(build: Callable[[Hosts], T]) -> Iterator[T]:
    """What ``build`` makes of a new ``Hosts`` (its namespaces and links), for the body; all
    of it deleted after. Skips (pytest), saying why, where this process cannot make
    namespaces or veth pairs."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed")
    made = Hosts()
    try:
        try:
            topology = build(made)
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot build network namespaces joined by veth: {' '.join(e.cmd)}: "
                        f"{e.stderr.strip()}")
        yield topology
    finally:
        made.destroy()
