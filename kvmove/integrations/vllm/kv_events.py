"""KV events for kvmove's tiers, in vLLM's own format: what the offload store holds, published
by vLLM's KV-events publisher beside vLLM's own events (``--kv-events-config``), so that a
router that scores on vLLM's events (llm-d's, Dynamo's, ``kvmove-serve --routing kv``) also
sees the prefixes kept in kvmove's host and disk tiers.

* A block stored in a tier: ``BlockStored`` with that tier's medium (host ``"CPU"``, disk
  ``"STORAGE"``: vLLM's ``MEDIUM_*`` names) and vLLM's own block hash, parent hash, token ids
  and LoRA: the same hashes vLLM's events give the block in its own KV cache (``"GPU"``).
* A block demoted from host to disk: ``BlockRemoved`` from ``"CPU"``, ``BlockStored`` in
  ``"STORAGE"``. A block dropped (evicted from the last tier, or corrupt): ``BlockRemoved``.
* What is stored comes from the worker's store (``KVStore.take_changes``, in each step's
  worker metadata): events follow the store, one step late, never the scheduler's intent.

The scheduler side (``OffloadScheduler``) names each block it asks the worker to save
(``saving``) and reports what the store did (``changed``); vLLM takes the events after each
step (``take_events``). Nothing is kept when vLLM's KV events are off.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

__all__ = ["MEDIA", "StoreEvents"]

MEDIA = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}

# Blocks asked to be saved whose outcome is not known yet (one step, or two with asynchronous
# scheduling): past this many the oldest are forgotten (a save the store never confirmed).
PENDING = 4096


@dataclass(frozen=True, slots=True)
class _Name:
    """What vLLM's events say of a block besides its medium."""

    block_hash: Any
    parent: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None


class StoreEvents:
    """The events of one engine's offload store (see the module's docstring)."""

    def __init__(self, vllm_config: Any, block_size: int) -> None:
        config = getattr(vllm_config, "kv_events_config", None)
        self.enabled = bool(getattr(config, "enable_kv_cache_events", False))
        self.block_size = block_size
        self._names: dict[int, _Name] = {}   # store key -> name, for blocks the store holds
        self._pending: collections.OrderedDict[int, _Name] = collections.OrderedDict()
        self._events: list[KVCacheEvent] = []

    def saving(self, request: Any, first: int, keys: list[int]) -> None:
        """``keys`` are blocks ``first``, ``first + 1``... of ``request``, asked to be saved."""
        if not self.enabled:
            return
        hashes, size = request.block_hashes, self.block_size
        lora = getattr(request, "lora_request", None)
        for i, key in enumerate(keys, start=first):
            self._pending[key] = _Name(
                maybe_convert_block_hash(hashes[i]),
                maybe_convert_block_hash(hashes[i - 1]) if i else None,
                list(request.all_token_ids[i * size:(i + 1) * size]),
                lora.adapter_id if lora else None, lora.name if lora else None)
            self._pending.move_to_end(key)
        while len(self._pending) > PENDING:
            self._pending.popitem(last=False)

    def changed(self, key: int, before: str | None, after: str | None) -> None:
        """The store moved block ``key`` from tier ``before`` to tier ``after`` (None: not
        held)."""
        if not self.enabled or before == after:
            return
        name = self._names.get(key) or self._pending.pop(key, None)
        if name is None:   # stored before this scheduler named it (e.g. a disk tier kept
            return         # across a restart): vLLM's hash is not known here
        if before is not None:
            self._events.append(BlockRemoved(block_hashes=[name.block_hash],
                                             medium=MEDIA[before], group_idx=0))
        if after is None:
            self._names.pop(key, None)
            return
        self._names[key] = name
        self._events.append(BlockStored(
            block_hashes=[name.block_hash], parent_block_hash=name.parent,
            token_ids=name.token_ids, block_size=self.block_size, lora_id=name.lora_id,
            medium=MEDIA[after], lora_name=name.lora_name, group_idx=0))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
