"""An identity of a model's weights as loaded: what a ``KVStore`` is told computed its KV
(``KVStore(weights=)``), so that new weights saved under an old name (a checkpoint directory
saved over) never get the old weights' stored KV.

What goes in: the model's config (``rope_theta`` or ``rms_norm_eps`` change the KV of the
same weights), then for every tensor of its state dict, in name order, its name, dtype, shape
and ``SAMPLE_ELEMENTS`` elements spread evenly over it (all of a smaller one).

We sample the tensors in memory rather than hash the files: a full hash of a multi-GB
checkpoint costs seconds to minutes at every start; a safetensors header names only dtypes,
shapes and offsets, which a fine-tune keeps; and the first and last bytes of a shard miss a
tensor changed in its middle. A dense update (training, fine-tuning, a merge) changes
practically every element of each tensor it touches, so the sample catches it, whichever
file holds it. An edit of a handful of elements (one row of one matrix) may fall between the
samples: serve such weights under a new name. The random presets go through the same path:
another seed, other weights, another identity.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import torch

from kvmove.engine.model import LlamaForCausalLM

__all__ = ["SAMPLE_ELEMENTS", "weights_id"]

# Per tensor: 4,096 elements; for Llama-3.1-8B's 291 tensors 2.4 MB gathered (milliseconds),
# where a full hash would read its 16 GB.
SAMPLE_ELEMENTS = 4096


def weights_id(model: LlamaForCausalLM) -> str:
    """``"sha256:<hex>"`` of the model's config and a sample of every tensor: equal for the
    same weights loaded again (any device, any process), different for other weights."""
    digest = hashlib.sha256(json.dumps(asdict(model.config), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"|{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(_sample(tensor))
    return f"sha256:{digest.hexdigest()}"


def _sample(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``SAMPLE_ELEMENTS`` elements evenly spaced over ``tensor``, first and
    last included (integer arithmetic: the same indices everywhere)."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n > SAMPLE_ELEMENTS:
        index = torch.arange(SAMPLE_ELEMENTS, dtype=torch.int64) * (n - 1) // (SAMPLE_ELEMENTS - 1)
        flat = flat[index.to(flat.device)]
    return flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()
