"""Two "hosts": one agent per network namespace, joined only by a veth pair.

Namespace A holds the sender (``helpers/two_hosts.py send``), namespace B the receiver
(``helpers/two_hosts.py receive``), each started with ``ip netns exec`` and given its veth
address as its agent's ``host``: that confines UCX's network transports to the veth (and
``UCX_TLS=tcp`` keeps shared memory out), and the metadata side channel listens on it. They
share a deployment key (``KVMOVE_KEY``); a third agent with another key is refused. The
receiver reports the sha256 of its whole cache, which must equal the reference computed here,
and the addresses it listens on (its veth address only); B's veth must have received at least
the bytes moved, and the sender must have reached it over UCX, not the same-host mapped
path (another network namespace is another host).

Needs root and ``ip netns``; skips cleanly otherwise. The namespaces (and the veth pair with
them) are always deleted, and both processes always killed.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.kv import pattern
from helpers.netns import Hosts, hosts, ip

# The script runs as ``python -m helpers.two_hosts`` from here, as the tests import it (and
# not from the repository root, where the source tree's kvmove, uncompiled, would come first).
TESTS = Path(__file__).resolve().parent
# Same geometry as helpers/two_hosts.py's defaults: 4 layers x 64 blocks x 512 B.
NUM_LAYERS, NUM_BLOCKS, BLOCK = 4, 64, 512
DEADLINE = 25.0  # the whole exchange, seconds
KEY = secrets.token_hex(16)  # the deployment's


class Namespaces:
    """ns_a <-veth-> ns_b: ``addr_a`` on ``dev_a`` in A, ``addr_b`` on ``dev_b`` in B."""

    def __init__(self, made: Hosts) -> None:
        self.hosts = made
        self.ns_a, self.ns_b = made.add("a"), made.add("b")
        self.addr_a, self.addr_b, self.dev_a, self.dev_b = made.link(self.ns_a, self.ns_b)

    def rx_bytes_b(self) -> int:
        return self.hosts.rx_bytes(self.ns_b, self.dev_b)


@pytest.fixture
def namespaces():
    with hosts(Namespaces) as made:
        yield made


class NsProcess:
    """``helpers/two_hosts.py ROLE ...`` inside a namespace, over tcp, with ``key``."""

    def __init__(self, ns: str, role: str, *args: str, key: str = KEY) -> None:
        env = {**os.environ, "UCX_TLS": "tcp", "KVMOVE_KEY": key, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "helpers.two_hosts", role, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS)
        self.lines: list[str] = []

    def read_line(self, prefix: str, deadline: float) -> str:
        """The first stdout line starting with ``prefix``, before ``deadline``."""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if not line:  # EOF: the process ended without saying it
                    break
                self.lines.append(line.rstrip("\n"))
                if line.startswith(prefix):
                    return line[len(prefix):].strip()
        raise AssertionError(f"no {prefix!r} line: {self.describe()}")

    def finish(self, deadline: float) -> str:
        """Waits for exit before ``deadline``; returns the rest of stdout; asserts exit 0."""
        try:
            out, err = self.proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"did not exit in time: {self.describe()}") from None
        self.lines += out.splitlines()
        assert self.proc.returncode == 0, f"exit {self.proc.returncode}: {err[-3000:]}"
        return out

    def describe(self) -> str:
        self.kill()
        _, err = self.proc.communicate(timeout=5)
        return f"exit {self.proc.returncode}; stdout {self.lines}; stderr {err[-3000:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def kill_all(*processes: NsProcess | None) -> None:
    for process in processes:
        if process is not None:
            process.kill()


def field(lines: list[str], prefix: str) -> str:
    found = [line[len(prefix):].strip() for line in lines if line.startswith(prefix)]
    assert found, f"no {prefix!r} in {lines}"
    return found[0]


def test_write_between_two_namespaces_over_veth(namespaces):
    ns = namespaces
    deadline = time.monotonic() + DEADLINE
    seed = 7
    # A's blocks 0..47 go to a shuffled set of 48 of B's 64 blocks.
    remote_ids = np.random.default_rng(seed).permutation(NUM_BLOCKS)[:48].tolist()
    expected = np.zeros((NUM_LAYERS, NUM_BLOCKS, BLOCK), dtype=np.uint8)
    expected[:, remote_ids] = pattern(seed, NUM_LAYERS, NUM_BLOCKS, BLOCK)[:, :48]
    nbytes = 48 * NUM_LAYERS * BLOCK

    rx_before = ns.rx_bytes_b()
    receiver = NsProcess(ns.ns_b, "receive", "--host", ns.addr_b, "--port", "47001",
                         "--timeout", "20")
    sender = stranger = None
    args = ["--host", ns.addr_b, "--bind", ns.addr_a, "--seed", str(seed),
            "--remote-ids", ",".join(map(str, remote_ids)), "--timeout", "15"]
    try:
        host, port = receiver.read_line("READY", deadline).split()
        assert (host, port) == (ns.addr_b, "47001")
        # An agent that reaches the port but holds another key is refused, and nothing of
        # it stays: the receiver still ends with exactly one peer.
        stranger = NsProcess(ns.ns_a, "send", "--port", port, *args, key=secrets.token_hex(16))
        with pytest.raises(AssertionError, match="not signed with this deployment's key"):
            stranger.finish(deadline)
        sender = NsProcess(ns.ns_a, "send", "--port", port, *args)
        sender.finish(deadline)
        receiver.finish(deadline)
    finally:
        kill_all(receiver, sender, stranger)

    assert field(sender.lines, "PEER") == "host-b"
    assert field(sender.lines, "STATE").endswith("DONE")
    # Same kernel, same user, both agents allow mapping (the default), but another network
    # namespace is another host: UCX carries the bytes.
    assert field(sender.lines, "PATH") == "ucx"
    assert int(field(sender.lines, "NBYTES")) == nbytes
    assert field(receiver.lines, "NOTIFY") == "host-a two-hosts"
    assert field(receiver.lines, "PEERS") == "host-a"
    assert field(receiver.lines, "SHA256") == hashlib.sha256(expected.tobytes()).hexdigest()
    assert field(receiver.lines, "LISTENING") == ns.addr_b, "a socket open to other networks"
    # Everything crossed the veth: B received at least the KV bytes (plus headers).
    assert ns.rx_bytes_b() - rx_before >= nbytes


def test_a_receiver_on_the_wildcard_advertises_the_address_peers_reach(namespaces):
    """Bound to 0.0.0.0, the receiver tells its peers an address of its own (its default
    route's: the veth's), and the sender in the other namespace reaches it there (an agent
    used to advertise "0.0.0.0", and its peers connected to themselves). With no route to
    tell an address by, listening refuses, saying so, instead of advertising a wildcard."""
    ns = namespaces
    deadline = time.monotonic() + DEADLINE
    receive = ("receive", "--host", "0.0.0.0", "--port", "47002", "--timeout", "20")
    refused = NsProcess(ns.ns_b, *receive)
    with pytest.raises(AssertionError, match="no route to tell peers an address by"):
        refused.finish(deadline)
    ip("-n", ns.ns_b, "route", "add", "default", "via", ns.addr_a)
    receiver = NsProcess(ns.ns_b, *receive)
    sender = None
    try:
        host, port = receiver.read_line("READY", deadline).split()
        assert host == ns.addr_b
        sender = NsProcess(ns.ns_a, "send", "--host", host, "--port", port, "--bind",
                           ns.addr_a, "--seed", "3", "--remote-ids", "5,6,7", "--timeout", "15")
        sender.finish(deadline)
        receiver.finish(deadline)
    finally:
        kill_all(refused, receiver, sender)
    assert field(receiver.lines, "NOTIFY") == "host-a two-hosts"


def test_the_users_ucx_net_devices_wins_over_the_agents_host(namespaces):
    """An agent on loopback (the default ``host``) keeps UCX on "lo"; with the user's
    ``UCX_NET_DEVICES`` naming the veth, UCX's tcp transport listens on the veth's address
    instead: the user's devices win (it used to be overridden, which on an RDMA host left
    out the RDMA devices)."""
    ns = namespaces
    script = ("import kvmove, sys\n"
              "from helpers.checks import listening_addresses\n"
              "from helpers.kv import make_cache\n"
              "layout = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype='float16',"
              " block_size=4)\n"
              "with kvmove.Agent('a', make_cache(layout, 4), transports='tcp') as agent:\n"
              "    print(sorted({h for h, _ in listening_addresses()}))\n")
    hosts = {}
    for devices in ("", ns.dev_b):
        env = {**os.environ, "UCX_NET_DEVICES": devices} if devices else \
            {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
        result = subprocess.run(["ip", "netns", "exec", ns.ns_b, sys.executable, "-c", script],
                                capture_output=True, text=True, env=env, cwd=TESTS,
                                timeout=DEADLINE)
        assert result.returncode == 0, result.stderr[-3000:]
        hosts[devices] = result.stdout.strip()
    assert hosts[""] == "['127.0.0.1']", hosts
    assert ns.addr_b in hosts[ns.dev_b] and "127.0.0.1" not in hosts[ns.dev_b], hosts
