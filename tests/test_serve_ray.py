"""``kvmove-serve --ray ADDRESS`` (``kvmove/serve/ray_workers.py``) on a real two-node Ray
cluster, every node pinned to 127.0.0.1: the head node has the ``prefill`` resource, the other
the ``decode`` one, so by default the prefill worker's actor lands on the head and the decode
worker's on the other node.

One cluster for the module (a start costs ~5-20 s here) and two servers, real processes with
the official ``openai`` client: the first serves the colocated engine's greedy text, survives
a decode actor killed by Ray (``ray.kill`` from this test's own driver: its stream ends with an
error, the worker comes back on its node) and is stopped with SIGTERM (no actor, no worker
left); the second is SIGKILLed (Ray kills the actors its driver owned, and their workers die
with them). The actors are named ``kvmove-serve-*``; this module lists the live ones with
``ray.util.list_named_actors`` (``ray.util.state`` needs Ray's dashboard, ``ray[default]``).

Before the cluster, ``--ray`` without an address: a Ray of its own, gone with the server (its
processes carry the server's tag). Without Ray every test but the option checks skips, saying
why. Every wait has a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from kvmove.engine.model import MODEL_PRESETS
from kvmove.engine.tokenizer import ByteTokenizer
from kvmove.errors import ConfigError
from kvmove.serve.config import ServeConfig
from kvmove.serve.ray_workers import default_resources

from helpers.greedy import greedy_tokens
from helpers.serve import WORKDIR, Server, process_alive, wait_until

# Ray resolves 127.0.0.1 to the host's primary address unless told to stay on loopback (read
# when ray is imported; kvmove-serve sets it itself for a loopback ADDRESS).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MODEL = "tiny"
TINY = MODEL_PRESETS[MODEL]
TOKENIZER = ByteTokenizer(TINY.bos_token_id, TINY.eos_token_id)
MAX_TOKENS = 16
LONG_TOKENS = 2000  # a stream that outlasts the kill
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["a", "Hello, world!", "héllo wörld ✓", "abcdefghijklmnopqrstuvwxyz ,." * 3]
ERROR_SECONDS = 10.0   # a killed actor's stream ends with an error within this
RESTART_SECONDS = 90.0  # a new actor placed, its worker importing torch, ready
GONE_SECONDS = 30.0     # actors and workers gone after the router stopped or died
ACTOR_PREFIX = "kvmove-serve-"


@pytest.fixture(scope="module")
def ray() -> Any:
    return pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvmove[ray]'")


@pytest.fixture(scope="module")
def cluster(ray: Any) -> Iterator[Any]:
    """Two nodes on 127.0.0.1 (one CPU each): the head with ``prefill``, one with ``decode``;
    this process a driver of it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 1, "resources": {"prefill": 1},
        "include_dashboard": False})
    try:
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=1, resources={"decode": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """The colocated engine's greedy tokens for every prompt (the tiny preset, seed 0: the
    weights every worker builds)."""
    return greedy_tokens(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(cluster: Any) -> Iterator[Server]:
    server = Server("--ray", cluster.address, "--mode", "disagg", "--chunk-size", "32")
    yield server
    server.close()


def node_with(ray: Any, resource: str) -> str:
    """The id of the (one) live node that has ``resource``."""
    [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def actors(ray: Any) -> list[dict[str, str]]:
    """kvmove-serve's live actors on the cluster."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(ACTOR_PREFIX)]


def actor_of(ray: Any, worker: str) -> Any:
    [found] = [a for a in actors(ray) if a["name"].rsplit("-", 1)[0].endswith(f"-{worker}")]
    return ray.get_actor(found["name"], namespace=found["namespace"])


def complete(server: Server, prompt: str) -> str:
    result = server.client().completions.create(model=MODEL, prompt=prompt,
                                                max_tokens=MAX_TOKENS, **GREEDY)
    return result.choices[0].text


# --- without Ray -------------------------------------------------------------------------------

def test_ray_without_ray_installed_exits_2_naming_the_extra(tmp_path: Path) -> None:
    """An unimportable ``ray`` (a module that raises ImportError first on the path)."""
    (tmp_path / "ray.py").write_text("raise ImportError('no Ray here')\n")
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-m", "kvmove.serve.cli", "--ray", "--port", "0"], cwd=WORKDIR,
        env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "pip install 'kvmove[ray]'" in result.stderr, result.stderr


def test_default_resources_are_the_roles_own_else_a_gpu() -> None:
    assert default_resources("prefill", {"CPU": 8, "prefill": 1}) == {"CPU": 1, "prefill": 1}
    assert default_resources("decode", {"CPU": 8, "GPU": 8}) == {"CPU": 1, "GPU": 1}
    assert default_resources("decode", {"CPU": 8}) == {"CPU": 1, "decode": 1}
    assert default_resources("decode", {"GPU": 8, "decode": 2}) == {"CPU": 1, "decode": 1}


@pytest.mark.parametrize("kwargs, words", [
    ({"ray_resources": {"prefill": {"CPU": 1}}}, ["needs ray"]),
    ({"ray": "local", "ray_resources": {"colocated": {"CPU": 1}}}, ["'colocated'", "disagg"]),
    ({"ray": "local", "ray_resources": {"decode": {"GPU": -1}}}, ["'GPU'", "-1"]),
    ({"ray": ""}, ["'local'"]),
])
def test_ray_options_are_checked(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        ServeConfig(**kwargs)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_ray_without_an_address_serves_on_a_ray_of_its_own(
        ray: Any, reference: dict[str, list[int]]) -> None:
    """Before the module's cluster starts: ``--ray`` alone starts a Ray here, on loopback, with
    the role resources its workers ask for; SIGTERM stops it, and every process the server
    started (Ray's included: they carry its tag) is gone."""
    server = Server("--ray", "--mode", "colocated", "--workers", "1")
    try:
        [worker] = server.health()["workers"]
        assert worker["node"] and process_alive(worker["pid"])
        assert complete(server, PROMPTS[1]) == TOKENIZER.decode(reference[PROMPTS[1]])
        assert "Started a local Ray instance" in server.stderr_text(tail=None)
    finally:
        server.close()  # fails if anything it started is left after SIGTERM


# --- on the cluster ----------------------------------------------------------------------------

def test_a_cluster_short_of_a_resource_is_refused_at_start_naming_it(cluster: Any) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmove.serve.cli", "--ray", cluster.address, "--prefill", "2",
         "--port", "0", "--model", MODEL], cwd=WORKDIR, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    message = result.stderr.splitlines()[-1]
    assert "2 'prefill' (it has 1)" in message and "3 'CPU' (it has 2)" in message, message
    assert "'decode'" not in message.split(";")[0] and "--ray-resources" in message, message



def test_workers_are_actors_placed_by_their_roles_resources(ray: Any, server: Server) -> None:
    workers = {w["name"]: w for w in server.health()["workers"]}
    assert workers["prefill-0"]["node"] == node_with(ray, "prefill")
    assert workers["decode-0"]["node"] == node_with(ray, "decode")
    assert node_with(ray, "prefill") != node_with(ray, "decode")
    assert sorted(a["name"].split("-")[3] for a in actors(ray)) == ["decode", "prefill"]
    assert all(process_alive(w["pid"]) for w in workers.values())
    # no --cpus under Ray: its num_cpus placed the workers
    for w in workers.values():
        with open(f"/proc/{w['pid']}/cmdline", "rb") as f:
            assert b"--cpus" not in f.read()


def test_greedy_text_equals_the_colocated_engine(server: Server,
                                                 reference: dict[str, list[int]]) -> None:
    for prompt in PROMPTS:
        assert complete(server, prompt) == TOKENIZER.decode(reference[prompt]), prompt


def test_a_ray_killed_decode_actor_ends_its_stream_and_the_server_serves_on(
        ray: Any, server: Server, reference: dict[str, list[int]]) -> None:
    old = server.worker("decode-0")
    chunks = iter(server.client(timeout=ERROR_SECONDS * 2).completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=LONG_TOKENS, stream=True, **GREEDY))
    for _ in range(3):
        assert next(chunks).choices[0].finish_reason is None
    ray.kill(actor_of(ray, "decode-0"))
    start = time.monotonic()
    with pytest.raises(openai.APIError) as error:
        for _ in chunks:
            pass
    seconds = time.monotonic() - start
    # the error event, not a read timeout or a dropped connection
    assert type(error.value) is openai.APIError, repr(error.value)
    assert "decode-0" in str(error.value) and seconds < ERROR_SECONDS, (str(error.value),
                                                                        seconds)
    wait_until(lambda: not process_alive(old["pid"]), ERROR_SECONDS,
               f"decode-0's worker (pid {old['pid']}) gone with its actor")
    wait_until(lambda: (server.worker("decode-0")["pid"] not in (None, old["pid"]) and
                        server.worker("decode-0")["ready"]), RESTART_SECONDS,
               "decode-0 started again (a new actor) and ready")
    assert server.worker("decode-0")["node"] == node_with(ray, "decode")
    assert server.health()["status"] == "ok"
    assert complete(server, PROMPTS[2]) == TOKENIZER.decode(reference[PROMPTS[2]])
    metrics = server.get("/metrics").text
    assert 'kvmove_worker_restarts_total{worker="decode-0"} 1.0' in metrics


def test_sigterm_leaves_no_actor_and_no_worker(ray: Any, server: Server) -> None:
    pids = [w["pid"] for w in server.health()["workers"]]
    assert len(actors(ray)) == 2
    assert server.stop() == 0
    wait_until(lambda: not actors(ray), GONE_SECONDS, lambda: f"no actor left: {actors(ray)}")
    wait_until(lambda: not any(process_alive(p) for p in pids), GONE_SECONDS,
               f"no worker process left of {pids}")


def test_a_sigkilled_router_leaves_no_actor_behind(ray: Any, cluster: Any,
                                                   server: Server) -> None:
    """After the shared server (stopped above): its actors die with its driver."""
    assert not server.running and not actors(ray)
    killed = Server("--ray", cluster.address, "--mode", "disagg", "--no-restart")
    try:
        pids = [w["pid"] for w in killed.health()["workers"]]
        assert len(actors(ray)) == 2 and all(process_alive(p) for p in pids)
        killed.process.kill()
        killed.process.wait(GONE_SECONDS)
        wait_until(lambda: not actors(ray), GONE_SECONDS,
                   lambda: f"no actor left: {actors(ray)}")
        wait_until(lambda: not any(process_alive(p) for p in pids), GONE_SECONDS,
                   f"no worker process left of {pids}")
    finally:
        killed.kill()
