"""GPU benchmarks for ``bench/gpu_check.sh`` (needs a CUDA build of kvmove, torch with CUDA and
one GPU). Three rows, each against a baseline measured in the same run:

1. pack / unpack: the Llama-3.1-8B 4,000-token KV (250 blocks x 32 layers x 64 KiB = 524 MB),
   blocks scattered over a 512-block device cache, into / out of one contiguous device buffer;
   against ``cudaMemcpy`` device-to-device of the same bytes (torch ``copy_``). Goal >= 80%.
2. transfer: the same KV written by ``Agent.write`` from this process's device cache into
   another process's on the same GPU (UCX picks cuda_ipc), every byte checked; against the
   same device-to-device copy.
3. layer streaming with a GPU prefill: per layer, float16 matmuls on the GPU calibrated to
   the layer's transfer time, then the layer's KV written by a kernel, an event recorded, and
   ``save_layer(i, event)``; the hidden fraction is ``1 - exposed / bulk`` where bulk is the
   whole transfer after the compute and exposed what is left of it after the last layer's
   compute.

Run: ``python bench/gpu_bench.py [--iters 5]``. Prints one table; ``--json`` for a file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from functools import partial

import torch

import kvmove
from kvmove import Agent, KVCache, KVSpec
from kvmove.bench.harness import Child
from kvmove.convert import pack, pack_nbytes, unpack

LAYOUT = KVSpec.preset("llama-3.1-8b")
TOKENS = 4000
CACHE_BLOCKS = 512
DEVICE = "cuda:0"
TIMEOUT = 60.0


def timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` (synchronous) after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw(cache: KVCache) -> torch.Tensor:
    return cache.torch().view(torch.uint8).view(cache.num_layers, cache.num_blocks, -1)


def memcpy_d2d(nbytes: int, iters: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return nbytes / timed(lambda: dst.copy_(src), iters) / 1e9


def bench_pack(iters: int) -> dict:
    cache = KVCache(LAYOUT, CACHE_BLOCKS, device=DEVICE)
    raw(cache).copy_(torch.randint(0, 256, raw(cache).shape, dtype=torch.uint8, device=DEVICE))
    n = LAYOUT.blocks_for(TOKENS)
    ids = torch.randperm(CACHE_BLOCKS)[:n].tolist()
    staging = torch.empty(pack_nbytes(cache, n), dtype=torch.uint8, device=DEVICE)
    pack_s = timed(lambda: pack(cache, ids, staging), iters)
    unpack_s = timed(lambda: unpack(staging, cache, ids), iters)
    assert torch.equal(staging.view(LAYOUT.num_layers, n, -1), raw(cache)[:, ids])
    return {"nbytes": staging.numel(), "pack_gbps": staging.numel() / pack_s / 1e9,
            "unpack_gbps": staging.numel() / unpack_s / 1e9}


def checksum(cache: KVCache, ids: list[int]) -> str:
    """sha256 of blocks ``ids`` in every layer."""
    return hashlib.sha256(raw(cache)[:, ids].cpu().numpy().tobytes()).hexdigest()


class Receiver:
    """The far process (``harness.Child``): a device cache and an agent named "receiver"."""

    def __init__(self, num_blocks: int) -> None:
        self.cache = KVCache(LAYOUT, num_blocks, device=DEVICE)
        self.agent = Agent("receiver", self.cache)
        self.loads: dict[str, kvmove.LoadStream] = {}

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def checksum(self, ids: list[int]) -> str:
        torch.cuda.synchronize()
        return checksum(self.cache, ids)

    def expect(self, request_id: str, ids: list[int]) -> int:
        load = self.agent.expect("sender", request_id, ids, timeout=TIMEOUT).start_load()
        self.loads[request_id] = load
        return load.epoch

    def wait_all(self, request_id: str) -> None:
        self.loads.pop(request_id).wait_all(TIMEOUT)

    def close(self) -> None:
        self.agent.close()


def receiver() -> Child:
    """A ``Receiver`` of ``CACHE_BLOCKS`` blocks in a spawned process; every reply has a
    deadline of ``TIMEOUT`` (a dead or wedged receiver is an error, never a hang)."""
    return Child(Receiver, CACHE_BLOCKS, name="gpu-bench-receiver", timeout=TIMEOUT)


def connected(far: Child, agent: Agent) -> None:
    """``agent`` ("sender") and the receiver, peers of each other."""
    agent.add_peer(far.call("metadata"))
    far.call("add_peer", agent.metadata())


def bench_transfer(iters: int) -> dict:
    n = LAYOUT.blocks_for(TOKENS)
    cache = KVCache(LAYOUT, CACHE_BLOCKS, device=DEVICE)
    raw(cache).copy_(torch.randint(0, 256, raw(cache).shape, dtype=torch.uint8, device=DEVICE))
    torch.cuda.synchronize()
    with receiver() as far, Agent("sender", cache) as agent:
        connected(far, agent)
        ids = cache.pool.allocate(n)
        seconds = timed(lambda: agent.write("receiver", ids, ids).wait(TIMEOUT), iters)
        verified = far.call("checksum", ids) == checksum(cache, ids)
    nbytes = n * LAYOUT.bytes_per_block
    return {"nbytes": nbytes, "gbps": nbytes / seconds / 1e9, "verified": verified}


def _layer_compute(size: int, repeats: int) -> torch.Tensor:
    a = torch.randn(size, size, device=DEVICE, dtype=torch.float16)
    for _ in range(repeats):
        a = torch.tanh(a @ a)
    return a


def _calibrate(per_layer: float) -> tuple[int, int, float]:
    """(matrix size, repeats, seconds) of GPU matmuls taking about ``per_layer`` seconds."""
    for size in (2048, 1024, 512, 256):
        one = timed(partial(_layer_compute, size, 20), 3) / 20
        if one <= per_layer or size == 256:
            repeats = max(1, round(per_layer / one))
            return size, repeats, timed(partial(_layer_compute, size, repeats), 3)
    raise AssertionError("unreachable")


def bench_stream(iters: int) -> dict:
    """Bulk vs streamed hand-off behind a GPU prefill, between two processes on one GPU."""
    n = LAYOUT.blocks_for(TOKENS)
    cache = KVCache(LAYOUT, CACHE_BLOCKS, device=DEVICE)
    ids = cache.pool.allocate(n)
    kv = torch.randint(0, 256, raw(cache)[0, ids].shape, dtype=torch.uint8, device=DEVICE)
    with receiver() as far, Agent("sender", cache) as agent:
        connected(far, agent)
        bulk = timed(lambda: agent.write("receiver", ids, ids).wait(TIMEOUT), iters)
        size, repeats, compute = _calibrate(bulk / LAYOUT.num_layers)
        hidden = []
        for i in range(iters):
            epoch = far.call("expect", f"r{i}", ids)
            stream = agent.stream_to("receiver", ids, ids, f"r{i}", epoch=epoch)
            for layer in range(LAYOUT.num_layers):
                _layer_compute(size, repeats)
                raw(cache)[layer, ids] = kv
                event = torch.cuda.Event()
                event.record()
                stream.save_layer(layer, event)  # the stream keeps the event
            torch.cuda.synchronize()
            computed = time.perf_counter()
            stream.wait_for_save(TIMEOUT)
            exposed = time.perf_counter() - computed
            far.call("wait_all", f"r{i}")  # the receiver has every layer
            hidden.append(1 - exposed / bulk)
    return {"bulk_seconds": bulk, "compute_per_layer_seconds": compute,
            "transfer_per_layer_seconds": bulk / LAYOUT.num_layers,
            "hidden_fraction": statistics.median(hidden)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    status = kvmove.cuda_status()
    if not status.device_count or not torch.cuda.is_available():
        print(f"no GPU here: {status.reason or 'torch has no CUDA'}")
        return 1
    baseline = memcpy_d2d(LAYOUT.blocks_for(TOKENS) * LAYOUT.bytes_per_block, args.iters)
    report = {"device": torch.cuda.get_device_name(0), "memcpy_d2d_gbps": baseline,
              "pack": bench_pack(args.iters), "transfer": bench_transfer(args.iters),
              "stream": bench_stream(args.iters)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    p, t, s = report["pack"], report["transfer"], report["stream"]
    print(f"{report['device']}: Llama-3.1-8B KV of {TOKENS:,} tokens, {p['nbytes']:,} B; "
          f"median of {args.iters}")
    print(f"cudaMemcpy D2D        {baseline:8.1f} GB/s  (baseline)")
    print(f"pack (scattered)      {p['pack_gbps']:8.1f} GB/s  {p['pack_gbps'] / baseline:6.1%}")
    print(f"unpack (scattered)    {p['unpack_gbps']:8.1f} GB/s  {p['unpack_gbps'] / baseline:6.1%}")
    print(f"Agent.write, 2 procs  {t['gbps']:8.1f} GB/s  {t['gbps'] / baseline:6.1%}  "
          f"verified={t['verified']}")
    print(f"streaming: bulk transfer {s['bulk_seconds'] * 1e3:.2f} ms; per layer, compute "
          f"{s['compute_per_layer_seconds'] * 1e3:.3f} ms vs transfer "
          f"{s['transfer_per_layer_seconds'] * 1e3:.3f} ms; hidden {s['hidden_fraction']:.1%}")
    return 0 if t["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
