"""The far side of test_wrap.py: an engine's tensors (helpers.engines), wrapped, behind an
``Agent`` in a spawned child process. Snapshots come back as numpy copies of the engine's own
tensors, so the parent checks them with the torch reference (``engines.kv_of``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvmove
from kvmove.bench.harness import Child

from helpers import engines


class WrapFar:
    """Commands the parent runs in the child; each returns a picklable value."""

    def __init__(self, name: str, engine: str, layout: kvmove.KVSpec, num_blocks: int,
                 agent_kwargs: dict) -> None:
        self.tensors, self.cache = engines.make(engine, layout, num_blocks)
        self.agent = kvmove.Agent(name, self.cache, **agent_kwargs)
        self.loads: dict[str, kvmove.LoadStream] = {}

    def close(self) -> None:
        self.agent.close()

    def fill(self, seed: int) -> None:
        engines.fill(self.tensors, seed)

    def snapshot(self) -> list[np.ndarray]:
        return [t.numpy().copy() for t in engines.snapshot(self.tensors)]

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def write(self, peer: str, local_ids: list[int], remote_ids: list[int],
              layers: list[int] | None = None, timeout: float = 10.0) -> int:
        """Returns the operations posted."""
        t = self.agent.write(peer, local_ids, remote_ids, layers=layers)
        t.wait(timeout)
        return t.stats.num_ops

    def read(self, peer: str, local_ids: list[int], remote_ids: list[int],
             layers: list[int] | None = None, timeout: float = 10.0) -> int:
        t = self.agent.read(peer, local_ids, remote_ids, layers=layers)
        t.wait(timeout)
        return t.stats.num_ops

    def expect(self, peer: str, request_id: str, ids: list[int]) -> int:
        load = self.agent.expect(peer, request_id, ids, timeout=30.0)
        self.loads[request_id] = load.start_load()
        return load.epoch

    def wait_all(self, request_id: str, timeout: float = 10.0) -> bytes:
        return self.loads.pop(request_id).wait_all(timeout)

    def stream(self, peer: str, local_ids: list[int], remote_ids: list[int], request_id: str,
               epoch: int, payload: bytes, timeout: float = 10.0) -> None:
        save = self.agent.stream_to(peer, local_ids, remote_ids, request_id, epoch=epoch)
        for layer in range(self.cache.num_layers):
            save.save_layer(layer)
        save.finish(payload)
        save.wait_for_save(timeout)


class FarWrapped(Child):
    """A ``WrapFar`` named ``name`` holding ``engine``'s tensors, in a spawned child."""

    def __init__(self, name: str, engine: str, layout: kvmove.KVSpec, num_blocks: int,
                 agent_kwargs: dict) -> None:
        super().__init__(WrapFar, name, engine, layout, num_blocks, agent_kwargs,
                         name=f"far-{name}", label=f"far process {name!r} ({engine})",
                         timeout=30.0, start_timeout=30.0)


def as_torch(arrays: list[Any]) -> list[Any]:
    import torch

    return [torch.from_numpy(a) for a in arrays]
