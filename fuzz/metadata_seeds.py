"""Writes fuzz/corpus/metadata/: the core's (unsigned) metadata of five agents, named by the
first 16 hex digits of their SHA-1 as libFuzzer names its inputs.

    python fuzz/metadata_seeds.py fuzz/corpus/metadata    # from outside the checkout's root

The agents cover the wire format's shapes: kvmove's own cache over tcp and over the default
transports, an MLA cache, a wrapped vLLM flash-attention cache (two planes per layer, a
segment per tensor) and a wrapped vLLM CPU-backend cache.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

import kvmove


def caches() -> list[tuple[str, kvmove.KVCache, str | None]]:
    small = kvmove.KVLayout(4, 2, 16, block_size=8)
    flash = {f"layers.{i}": np.zeros((2, 8, 8, 2, 16), np.float16) for i in range(2)}
    cpu = [np.zeros((8, 2, 8, 32), np.float16) for _ in range(2)]
    two = kvmove.KVLayout(2, 2, 16, block_size=8)
    return [
        ("seed-tcp", kvmove.KVCache(small, 8), "tcp"),
        ("seed-default", kvmove.KVCache(kvmove.KVLayout(2, 8, 128, "bfloat16"), 4), None),
        ("seed-mla", kvmove.KVCache(kvmove.KVLayout(2, 1, 576, block_size=64, mla=True), 2),
         "tcp"),
        ("seed-flash", kvmove.KVCache.wrap(flash, layout=two, block_dim=1, kv_dim=0, pool=None),
         "tcp"),
        ("seed-vllm-cpu", kvmove.KVCache.wrap(cpu, layout=two, block_dim=0, order="vllm-cpu"),
         "tcp"),
    ]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, cache, transports in caches():
        with kvmove.Agent(name, cache, transports=transports) as agent:
            blob = agent.key.verify(agent.metadata())
        (out / hashlib.sha1(blob).hexdigest()[:16]).write_bytes(blob)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
