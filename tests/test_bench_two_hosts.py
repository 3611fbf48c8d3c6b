"""``kvmove-bench transfer`` between two "machines": ``--listen`` in one network namespace,
``--connect`` in another, joined only by a veth pair, as a user runs it between two hosts
(and as ``ucx_perftest`` runs). The run must verify every byte, go over UCX (another namespace
is another host: never the mapped path) on the veth, and take its ``ucx_perftest`` baseline from
a server on the listening side. A connection that never completes the key handshake, and a
``--connect`` with another deployment key, are refused before any command is read, and the
listening side goes on to serve the right one.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmove.bench.remote import HANDSHAKE_SECONDS

from helpers.checks import WORKDIR
from helpers.netns import Hosts, hosts

DEADLINE = 240.0
PORT = "47613"
TINY = ("--model", "llama-3.2-1b", "--tokens", "64", "--iters", "1", "--transports", "tcp")


@dataclass
class Pair:
    hosts: Hosts
    ns_near: str
    ns_far: str
    addr_near: str
    addr_far: str
    dev_far: str


def pair(made: Hosts) -> Pair:
    near, far = made.add("near"), made.add("far")
    addr_near, addr_far, _, dev_far = made.link(near, far)
    return Pair(made, near, far, addr_near, addr_far, dev_far)


def bench(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "kvmove.bench.cli", "transfer",
            *args]


def key_file(path: Path) -> str:
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


def read_until(process: subprocess.Popen, text: str, deadline: float) -> list[str]:
    """stdout lines of ``process`` up to one holding ``text``."""
    lines: list[str] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if text in line:
                return lines
    raise AssertionError(f"no {text!r} from the listening side: {lines}")


def test_transfer_between_two_namespaces(tmp_path: Path) -> None:
    key, other = key_file(tmp_path / "key"), key_file(tmp_path / "other")
    deadline = time.monotonic() + DEADLINE
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with hosts(pair) as net:
        listener = subprocess.Popen(bench(net.ns_far, "--listen", f"{net.addr_far}:{PORT}",
                                          "--key-file", key),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=WORKDIR, env=env)
        try:
            read_until(listener, "listening on", deadline)
            target = f"{net.addr_far}:{PORT}"
            # A connection that says nothing holds the port for HANDSHAKE_SECONDS at most.
            silent = subprocess.Popen(
                ["ip", "netns", "exec", net.ns_near, sys.executable, "-c",
                 "import socket, time; s = socket.create_connection("
                 f"('{net.addr_far}', {PORT})); time.sleep({HANDSHAKE_SECONDS + 10})"])
            try:
                read_until(listener, "refused a connection without our key (1 so far)",
                           deadline)
            finally:
                silent.kill()
                silent.wait()
            stranger = subprocess.run(bench(net.ns_near, "--connect", target, "--key-file",
                                            other, *TINY),
                                      capture_output=True, text=True, cwd=WORKDIR, env=env,
                                      timeout=60)
            assert stranger.returncode == 1, stranger.stderr
            assert "holds another deployment key" in stranger.stderr, stranger.stderr
            read_until(listener, "refused a connection without our key (2 so far)", deadline)
            rx_before = net.hosts.rx_bytes(net.ns_far, net.dev_far)
            run = subprocess.run(bench(net.ns_near, "--connect", target, "--key-file", key,
                                       "--json", *TINY),
                                 capture_output=True, text=True, cwd=WORKDIR, env=env,
                                 timeout=deadline - time.monotonic())
            assert run.returncode == 0, run.stderr[-3000:]
            out, err = listener.communicate(timeout=30)
            assert listener.returncode == 0, err[-3000:]
            assert "the --connect run ended" in out
        finally:
            if listener.poll() is None:
                listener.kill()
                listener.communicate()
        data = json.loads(run.stdout)
        assert data["verified"] is True
        assert data["config"]["connect"] == target
        assert data["config"]["host"] == net.addr_near   # the route's address, found by itself
        assert data["path"] == "ucx"   # another host: never the mapped path
        assert data["transports_used"] and all(t.startswith("tcp/")
                                               for t in data["transports_used"])
        # the far side's ucx_perftest server gave the same-link baseline
        assert any(p["available"] for p in data["baselines"]["perftest_bw"]), \
            data["baselines"]["perftest_bw"]
        written = sum(row["nbytes"] for row in data["rows"] if row["op"] == "write")
        assert net.hosts.rx_bytes(net.ns_far, net.dev_far) - rx_before >= written


@pytest.mark.parametrize("args, words", [
    (("--connect", "nowhere"), "connect must be HOST:PORT"),
    (("--connect", "10.0.0.1:0"), "connect must be HOST:PORT with a port in 1-65535"),
    (("--listen", "127.0.0.1:99999"), "--listen must be [HOST:]PORT"),
    (("--connect", "127.0.0.1:1", "--against", "nixl"), "cannot run with connect"),
    (("--connect", "127.0.0.1:1", "--key-file", "/nonexistent/key"), "/nonexistent/key"),
])
def test_bad_two_machine_options_exit_2_naming_the_value(args: tuple[str, ...],
                                                          words: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "transfer", *args],
                            capture_output=True, text=True, cwd=WORKDIR, timeout=60)
    assert result.returncode == 2, result.stderr
    assert words in result.stderr, result.stderr


def test_listen_and_connect_are_one_or_the_other() -> None:
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "transfer", "--listen",
                             "5000", "--connect", "127.0.0.1:5000"],
                            capture_output=True, text=True, cwd=WORKDIR, timeout=60)
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_a_connect_with_nothing_listening_fails_naming_the_address() -> None:
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "transfer", "--connect",
                             "127.0.0.1:9", *TINY],
                            capture_output=True, text=True, cwd=WORKDIR, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "cannot reach the listening side at 127.0.0.1:9" in result.stderr, result.stderr
