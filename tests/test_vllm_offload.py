"""The offload connector (``kv_role: kv_both``, ``offload: true``) inside a real vLLM: a
repeated prompt is served from kvmove's store (host and disk tiers) and gives the text a vLLM
without any connector gives; a corrupt disk block is recomputed, never served.

Two servers, started together and shared by the tests: ``plain`` (no connector, the ground
truth) and ``offload`` (a host tier of 3 blocks, so most of a prompt's blocks go to a disk
tier in a temporary directory). vLLM's own prefix cache is off in both, so a second equal
prompt can only be served by the connector.
"""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest

from helpers.vllm_servers import (
    SHAPES,
    VLLMServer,
    free_port,
    kv_transfer_config,
    require_vllm,
    write_checkpoint,
)

openai = require_vllm()

BLOCK_SIZE = 32   # vLLM's CPU attention takes multiples of 32
HOST_BLOCKS = 3
START_SECONDS = 600.0   # two servers starting at once on a shared 2-core machine
SERVER_ARGS = ("--no-enable-prefix-caching", "--block-size", str(BLOCK_SIZE))
LOADED = re.compile(r"loaded (\d+) of (\d+) blocks \((\d+) tokens, (\d+) bytes\) of "
                    r"request (\S+)")


def _block_nbytes(shape: str = "tiny") -> int:
    s = SHAPES[shape]
    return s["num_layers"] * BLOCK_SIZE * 2 * s["num_kv_heads"] * s["head_dim"] * 4  # float32


def _prompt(seed: int) -> str:
    """About 330 tokens of text that shares no leading block with another seed's."""
    words = ["river", "stone", "amber", "quiet", "north", "lamp", "orbit", "cedar", "velvet",
             "harbor", "signal", "meadow", "copper", "lantern", "echo", "summit"]
    return " ".join(words[(seed * 7 + i * (seed + 3)) % len(words)] + str(seed)
                    for i in range(50))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-offload")
    model = write_checkpoint(str(root / "model"))
    disk = str(root / "store")
    # load_policy "always": with "auto" a tiny model's recompute (~0.3 ms a block
    # here) and a 64 KiB O_DIRECT read are too close to call, and the second request may
    # load its host blocks alone; these tests are about what is loaded, not when it pays.
    config = kv_transfer_config("kv_both", kv_port=free_port(), offload=True,
                                store_host_gb=HOST_BLOCKS * _block_nbytes() / (1 << 30),
                                store_disk_dir=disk, store_disk_gb=0.01, load_policy="always")
    with VLLMServer(model, name="plain", args=SERVER_ARGS, log_dir=str(root)) as plain, \
            VLLMServer(model, name="offload", kv_config=config, args=SERVER_ARGS,
                       log_dir=str(root)) as offload:
        plain.wait_ready(START_SECONDS)
        offload.wait_ready(START_SECONDS)
        yield plain, offload, disk


def _complete(server: VLLMServer, prompt: str) -> tuple[str, int, float]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60.0)
    start = time.perf_counter()
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens, time.perf_counter() - start


def _loads(server: VLLMServer) -> list[tuple[int, int, int]]:
    """(blocks loaded, blocks asked for, bytes) of each load the worker logged."""
    return [(int(m[1]), int(m[2]), int(m[4])) for m in LOADED.finditer(server.log_text())]


def _wait_for_loads(server: VLLMServer, n: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while len(loads := _loads(server)) < n and time.monotonic() < deadline:
        time.sleep(0.2)   # the worker's log reaches the file through a pipe
    return loads


def _external_hits(server: VLLMServer, expected: int, timeout: float = 10.0) -> float:
    """vLLM's own count of prompt tokens a connector served (``/metrics``), once it reaches
    ``expected`` or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(server.url + "/metrics", timeout=5.0).text
        hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:external_prefix_cache_hits_total"))
        if hits >= expected or time.monotonic() > deadline:
            return hits
        time.sleep(0.5)


def test_repeat_prompt_loads_from_store_and_matches_plain_vllm(servers):
    plain, offload, _ = servers
    prompt = _prompt(1)
    expected, num_tokens, _ = _complete(plain, prompt)
    assert num_tokens >= 6 * BLOCK_SIZE
    first, _, first_s = _complete(offload, prompt)
    assert first == expected
    assert _loads(offload) == []     # nothing stored before the first request
    second, _, second_s = _complete(offload, prompt)
    assert second == expected
    loads = _wait_for_loads(offload, 1)
    whole = (num_tokens - 1) // BLOCK_SIZE   # vLLM computes at least the last token
    assert loads == [(whole, whole, whole * _block_nbytes())], offload.log_tail()
    assert "(disk/host)" in offload.log_text()   # some blocks from host, the rest from disk
    assert _external_hits(offload, whole * BLOCK_SIZE) == whole * BLOCK_SIZE
    print(f"\n{num_tokens} prompt tokens: first {first_s * 1e3:.0f} ms, second (from the "
          f"store: {whole} blocks, {whole * _block_nbytes()} B) {second_s * 1e3:.0f} ms")


def test_corrupt_disk_block_is_recomputed_not_served(servers):
    plain, offload, disk = servers
    prompt = _prompt(2)
    expected, num_tokens, _ = _complete(plain, prompt)
    assert _complete(offload, prompt)[0] == expected
    before = len(_loads(offload))
    with open(os.path.join(disk, "blocks.dat"), "r+b") as f:   # every disk block damaged
        size = f.seek(0, os.SEEK_END)
        for offset in range(0, size, 4096):
            f.seek(offset)
            f.write(b"\xff" * 64)
    assert _complete(offload, prompt)[0] == expected
    loads = _wait_for_loads(offload, before + 1)
    whole = (num_tokens - 1) // BLOCK_SIZE
    assert loads[before][:2] == (HOST_BLOCKS, whole), offload.log_tail()
    assert "Recovered from KV load failure" in offload.log_text()
