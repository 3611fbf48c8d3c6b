"""Writes fuzz/corpus/metadata/: the core's (unsigned) metadata of six agents, named by the
first 16 hex digits of their SHA-1 as libFuzzer names its inputs.

    python fuzz/metadata_seeds.py fuzz/corpus/metadata    # from outside the checkout's root

The agents cover the wire format's shapes: kvmove's own cache over tcp and over the default
transports, an MLA cache, a wrapped vLLM flash-attention cache (two planes per layer, a
segment per tensor), a wrapped vLLM CPU-backend cache, and a tensor-parallel rank (heads
[2, 4) of 4).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

import kvmove


def caches() -> list[tuple[str, kvmove.KVCache, str | None, tuple[int, int] | None]]:
    small = kvmove.KVSpec(4, 2, 16, block_size=8)
    flash = {f"layers.{i}": np.zeros((2, 8, 8, 2, 16), np.float16) for i in range(2)}
    cpu = [np.zeros((8, 2, 8, 32), np.float16) for _ in range(2)]
    two = kvmove.KVSpec(2, 2, 16, block_size=8)
    return [
        ("seed-tcp", kvmove.KVCache(small, 8), "tcp", None),
        ("seed-default", kvmove.KVCache(kvmove.KVSpec(2, 8, 128, "bfloat16"), 4), None, None),
        ("seed-mla", kvmove.KVCache(kvmove.KVSpec(2, 1, 576, block_size=64, mla=True), 2),
         "tcp", None),
        ("seed-flash", kvmove.KVCache.wrap(flash, layout=two, block_dim=1, kv_dim=0, pool=None),
         "tcp", None),
        ("seed-vllm-cpu", kvmove.KVCache.wrap(cpu, layout=two, block_dim=0, order="vllm-cpu"),
         "tcp", None),
        ("seed-tp", kvmove.KVCache(small, 4), "tcp", (2, 4)),
    ]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, cache, transports, kv_heads in caches():
        with kvmove.Agent(name, cache, transports=transports, kv_heads=kv_heads) as agent:
            blob = agent.key.verify(agent.metadata())
        (out / hashlib.sha1(blob).hexdigest()[:16]).write_bytes(blob)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
