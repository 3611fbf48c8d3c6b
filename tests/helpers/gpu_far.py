"""A far agent whose KVCache is in GPU memory, for ``test_gpu.py``: ``StreamFar`` with a
device cache, whose bytes move through torch (a device cache has no numpy view). Nothing here
mocks the data path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from helpers.far import FarPeer
from helpers.kv import pattern
from helpers.stream_far import StreamFar


class GpuFar(StreamFar):
    """Built with the device as its fifth argument (``FarAgent``'s ``device``)."""

    def _bytes(self) -> Any:
        """The cache's bytes, ``[L, N, block_nbytes]`` uint8, on its device."""
        c = self.cache
        return c.torch().view(torch.uint8).view(c.num_layers, c.num_blocks, -1)

    def fill(self, seed: int) -> None:
        raw = self._bytes()
        raw.copy_(torch.from_numpy(pattern(seed, *raw.shape)))
        torch.cuda.synchronize()

    def snapshot(self) -> np.ndarray:
        return self._bytes().cpu().numpy()


def gpu_peer(name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
             device: str = "cuda:0") -> FarPeer:
    return FarPeer(name, layout_kwargs, num_blocks, agent_kwargs, device, host=GpuFar,
                   start_timeout=60.0)
