"""The same-host paths side by side in one run: a write and a read of Llama-3.1-8B's 4,000-token
KV (524 MB, 250 blocks of 32 layers) from this process into a peer process that it maps
(``peer_path == "mapped"``) and into one that refuses mapping (``same_host="ucx"``: UCX's
default transports), and a numpy memcpy of the same bytes, interleaved, best of 4 rounds; then
every byte each path wrote is compared. Prints GB/s and each as a share of memcpy.

    PYTHONPATH=.:tests python bench/same_host_paths.py      # from the repository root
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

import kvmove

from helpers.far import FarPeer
from helpers.kv import fill, raw_view

LAYOUT = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
NUM_BLOCKS = 250
ROUNDS = 4
WAIT = 60.0


def measure(near: kvmove.Agent, peers: dict[str, str], nbytes: int) -> dict[str, float]:
    """Best seconds per path and op, and of memcpy, over interleaved rounds."""
    ids = list(range(NUM_BLOCKS))
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best: dict[str, float] = {}

    def timed(key: str, run: Callable[[], object]) -> None:
        start = time.perf_counter()
        run()
        best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)

    for _ in range(ROUNDS):
        for path, name in peers.items():
            timed(f"{path} write", lambda name=name: near.write(name, ids, ids).wait(WAIT))
            timed(f"{path} read", lambda name=name: near.read(name, ids, ids).wait(WAIT))
        timed("memcpy", lambda: np.copyto(dst, src))
    return best


def main() -> None:
    fars = {"mapped": FarPeer("far-map", LAYOUT, NUM_BLOCKS, {}),
            "ucx": FarPeer("far-ucx", LAYOUT, NUM_BLOCKS, {"same_host": "ucx"})}
    try:
        cache = kvmove.KVCache(kvmove.KVSpec(**LAYOUT), NUM_BLOCKS)
        fill(cache, 1)
        with kvmove.Agent("near", cache) as near:
            peers = {path: near.connect(*far.call("listen")) for path, far in fars.items()}
            assert {path: near.peer_path(name) for path, name in peers.items()} == \
                {"mapped": "mapped", "ucx": "ucx"}
            nbytes = raw_view(cache).nbytes
            best = measure(near, peers, nbytes)
            expected = fill(cache, 2)
            for path, name in peers.items():
                near.write(name, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))).wait(WAIT)
                assert (fars[path].call("snapshot") == expected).all(), f"{path}: bytes differ"
        memcpy = best["memcpy"]
        print(f"memcpy (numpy copyto) {nbytes / memcpy / 1e9:.2f} GB/s")
        for key in ("mapped write", "mapped read", "ucx write", "ucx read"):
            print(f"{key:13s} {nbytes / best[key] / 1e9:6.2f} GB/s  {memcpy / best[key]:6.1%} "
                  "of memcpy")
        print(f"mapped / ucx: write {best['ucx write'] / best['mapped write']:.1f}x, "
              f"read {best['ucx read'] / best['mapped read']:.1f}x")
    finally:
        for far in fars.values():
            far.stop()


if __name__ == "__main__":
    main()
