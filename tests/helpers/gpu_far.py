"""A far agent whose KVCache is in GPU memory, for ``test_gpu.py``: ``peers.FarPeer`` with a
child that allocates ``KVCache(device=...)`` and moves its bytes through torch (a device
cache has no numpy view). Nothing here mocks the data path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from helpers.far import FarPeer, _Far, pattern, serve_far


class _GpuFar(_Far):
    def __init__(self, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
                 device: str):
        import torch

        import kvmove

        self.kvmove = kvmove
        self.torch = torch
        self.cache = kvmove.KVCache(kvmove.KVLayout(**layout_kwargs), num_blocks, device=device)
        self.agent = kvmove.Agent(name, self.cache, **agent_kwargs)
        self.transfers: list[Any] = []
        self.loads: dict[str, Any] = {}

    def _bytes(self) -> Any:
        """The cache's bytes, ``[L, N, block_nbytes]`` uint8, on its device."""
        c = self.cache
        return c.torch().view(self.torch.uint8).view(c.num_layers, c.num_blocks, -1)

    def fill(self, seed: int) -> None:
        raw = self._bytes()
        raw.copy_(self.torch.from_numpy(pattern(seed, *raw.shape)))
        self.torch.cuda.synchronize()

    def snapshot(self) -> np.ndarray:
        return self._bytes().cpu().numpy()

    def expect(self, peer: str, request_id: str, local_ids: list[int]) -> None:
        self.loads[request_id] = self.agent.expect(peer, request_id, local_ids).start_load()

    def wait_all(self, request_id: str, timeout: float) -> bytes:
        return self.loads[request_id].wait_all(timeout)


def serve_gpu(conn: Any, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
              device: str) -> None:
    serve_far(conn, _GpuFar, name, layout_kwargs, num_blocks, agent_kwargs, device)


def gpu_peer(name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
             device: str = "cuda:0") -> FarPeer:
    return FarPeer(name, layout_kwargs, num_blocks, agent_kwargs, 60.0, target=serve_gpu,
                   extra=(device,))
