"""``kvmove-serve --ray`` across two "hosts": a Ray cluster of two nodes, each in a network
namespace of its own (``ray start`` in each, joined by a veth pair, Ray's token
authentication on), the head holding the ``prefill`` resource and the other node ``decode``.
kvmove-serve runs on the head's host with ``--agent-host 0.0.0.0``, so each worker advertises
its own node's address (the decode once connected to itself when ``0.0.0.0`` was advertised),
and a deployment key file; this test reaches its HTTP over a third veth. Every answer must be
the colocated engine's, and the KV must cross the veth between the nodes.

Both namespaces share one kernel, so UCX's shared-memory transports would reach across them:
the server names ``--transports tcp``, as two hosts have only the network.

Ray's processes carry a tag in their environment; the test kills exactly those (``ray stop``
would stop every Ray of the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmove.engine.model import MODEL_PRESETS

from helpers.greedy import greedy_tokens
from helpers.netns import ROOT, Hosts, hosts, ip
from helpers.serve import TAG_VARIABLE, WORKDIR, Server, tagged_pids

pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvmove[ray]'")

from test_serve_ray import GREEDY, MAX_TOKENS, MODEL, PROMPTS, TOKENIZER  # noqa: E402

RAY_PORT = 6391
START_SECONDS = 120.0


@dataclass
class Nodes:
    head: str
    node: str
    head_addr: str
    node_addr: str
    node_dev: str
    http_addr: str   # the head's address on its link to this namespace
    hosts: Hosts


def nodes(made: Hosts) -> Nodes:
    head, node = made.add("rayhead"), made.add("raynode")
    head_addr, node_addr, _, node_dev = made.link(head, node)
    # Each "host" routes by default over the veth: an agent on 0.0.0.0 advertises that address.
    ip("-n", head, "route", "add", "default", "via", node_addr)
    ip("-n", node, "route", "add", "default", "via", head_addr)
    _, http_addr, _, _ = made.link(ROOT, head)
    return Nodes(head, node, head_addr, node_addr, node_dev, http_addr, made)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Nodes, dict[str, str]]]:
    tag = f"kvmove-ray-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, TAG_VARIABLE: tag, "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # test_serve_ray's loopback switch (its cluster is pinned to 127.0.0.1): not for real nodes
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    ray = str(Path(sys.executable).parent / "ray")
    # Ray's unix sockets live under --temp-dir: keep the path short.
    temps = [tempfile.mkdtemp(prefix="kr", dir="/tmp") for _ in range(2)]
    with hosts(nodes) as net:
        try:
            start = [ray, "start", "--num-cpus=1", "--disable-usage-stats"]
            for ns, args in (
                    (net.head, ["--head", "--include-dashboard=false",
                                f"--node-ip-address={net.head_addr}",
                                f"--port={RAY_PORT}", "--resources", '{"prefill": 1}',
                                f"--temp-dir={temps[0]}"]),
                    (net.node, [f"--address={net.head_addr}:{RAY_PORT}",
                                f"--node-ip-address={net.node_addr}", "--resources",
                                '{"decode": 1}', f"--temp-dir={temps[1]}"])):
                done = subprocess.run(["ip", "netns", "exec", ns, *start, *args], env=env,
                                      capture_output=True, text=True, cwd=WORKDIR,
                                      timeout=START_SECONDS)
                if done.returncode != 0:
                    pytest.fail(f"ray start in {ns} failed: {done.stderr[-3000:]}")
            yield net, env
        finally:
            for pid in tagged_pids(tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 20
            while tagged_pids(tag) and time.monotonic() < deadline:
                time.sleep(0.2)
            for temp in temps:
                shutil.rmtree(temp, ignore_errors=True)
            assert not tagged_pids(tag), "Ray processes left behind"


def test_disaggregated_serving_across_two_ray_nodes_on_two_hosts(cluster, tmp_path: Path):
    net, env = cluster
    key = tmp_path / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    reference = greedy_tokens(PROMPTS, MAX_TOKENS)
    server = Server("--ray", f"{net.head_addr}:{RAY_PORT}", "--mode", "disagg",
                    "--chunk-size", "32", "--host", net.http_addr, "--agent-host", "0.0.0.0",
                    "--transports", "tcp", "--key-file", str(key),
                    env={k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")},
                    netns=net.head)
    try:
        rx_before = net.hosts.rx_bytes(net.node, net.node_dev)
        client = server.client()
        for prompt in PROMPTS:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                            **GREEDY)
            assert out.choices[0].text == TOKENIZER.decode(reference[prompt]), prompt
        received = net.hosts.rx_bytes(net.node, net.node_dev) - rx_before

        def workers_now() -> dict:
            return {w["role"]: w for w in server.health()["workers"]}

        # The decode's stats in /health may trail its last lease by a refresh.
        deadline = time.monotonic() + 10.0
        while (workers := workers_now())["decode"]["agent"]["leases_granted"] < len(PROMPTS) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.close()
    # one worker per node, and the decode leased blocks to the prefill for every request
    assert workers["prefill"]["node"] != workers["decode"]["node"], workers
    assert workers["decode"]["agent"]["leases_granted"] == len(PROMPTS), workers
    # the prompts' KV (all but each prompt's last token, at least) crossed the veth
    per_token = MODEL_PRESETS[MODEL].kv_spec(16).bytes_per_block // 16
    kv_bytes = sum((len(TOKENIZER.encode(p)) - 1) * per_token for p in PROMPTS)
    assert received >= kv_bytes, (received, kv_bytes)
