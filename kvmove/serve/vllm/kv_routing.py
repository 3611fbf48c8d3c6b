"""KV-aware routing in front of vLLM (``kvmove-serve --vllm-prefill ... --routing kv``): each
request goes to the prefill instance that holds the longest prefix of its prompt, as the
instances' own KV events tell, scored as the own engine's router scores its workers
(``kvmove.serve.kv_index``: one ``KVIndex``, one ``choose``, the same metrics).

* **Events.** Each prefill instance started with vLLM's ``--kv-events-config`` publishes
  ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` over ZeroMQ. The proxy finds where at
  start (``GET /kv_event_sources``, vLLM's own endpoint; a ``*`` host is the instance's) and
  subscribes. Media: vLLM's own cache (``"GPU"``, whatever the device) is the index's
  ``cache``; kvmove's offload tiers under it (``"CPU"``, ``"STORAGE"``:
  ``kvmove.integrations.vllm.kv_events``) are its ``store``.
* **Hashes.** vLLM's block hashes are seeded per process (``PYTHONHASHSEED``) and cannot be
  recomputed here. Every ``BlockStored`` carries its tokens and its parent, so the index keys
  blocks by a chain of its own over the same tokens (``kvmove.block_hashes``, as the own
  engine's router), kept beside vLLM's hash so that a removal (hashes only) finds it. A block
  whose parent the proxy never heard of (it subscribed late) is not indexed.
* **Prompts.** The proxy tokenizes a request with vLLM's ``/tokenize`` on a prefill instance
  (the model's own tokenizer and chat template; one local round trip), then hashes its full
  blocks as the events' blocks are hashed.
* Not covered: what else vLLM hashes into a block (LoRA, multimodal inputs, ``cache_salt``)
  is not in the chain: two such prompts with equal tokens look alike to the router. That
  costs a misplaced request (a prefill where a hit was expected), never wrong KV: vLLM
  itself still matches by its own hash.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq

from kvmove.block_pool import block_hashes, prefix_hashes
from kvmove.serve.kv_index import Candidate, Decision, KVIndex, choose

__all__ = ["MEDIA", "EventSubscriber", "Placement", "event_endpoint", "score"]

log = logging.getLogger(__name__)

MEDIA = {"GPU": "cache", "CPU": "store", "STORAGE": "store"}   # vLLM's medium -> the index's
POLL_MS = 100


def event_endpoint(source: dict, instance_url: str) -> str | None:
    """Where to subscribe to one of ``/kv_event_sources``'s publishers: its endpoint, a
    wildcard host replaced by the instance's; None for one that connects out (vLLM binds only
    a ``*``, ``::`` or ``ipc://`` endpoint) or is off."""
    if not source.get("enable_kv_cache_events") or source.get("publisher") != "zmq":
        return None
    endpoint = str(source.get("endpoint") or "")
    if endpoint.startswith("ipc://"):
        return endpoint
    host = urlsplit(instance_url).hostname or "127.0.0.1"
    if "*" in endpoint:
        return endpoint.replace("*", f"[{host}]" if ":" in host else host, 1)
    if "[::]" in endpoint:
        return endpoint.replace("[::]", f"[{host}]" if ":" in host else host, 1)
    return None


@dataclass
class _Blocks:
    """One instance's blocks as its events said: vLLM's hash -> (our hash, its media)."""

    ours: dict[Any, int] = field(default_factory=dict)
    media: dict[Any, set[str]] = field(default_factory=dict)
    block_size: int | None = None


@dataclass(eq=False)
class Placement:
    """A request placed on an instance, until its prefill ends: counted there as coming
    (its blocks, as if cached) and pending (its uncached tokens)."""

    instance: str
    hashes: set[int]
    uncached: int


class EventSubscriber:
    """vLLM instances' KV events into one ``KVIndex``; a thread of its own reads them."""

    def __init__(self) -> None:
        self.index = KVIndex()
        self.lock = threading.RLock()          # the index and the blocks
        self._blocks: dict[str, _Blocks] = {}  # by instance URL
        self._new: list[tuple[str, str]] = []  # (instance, endpoint) not yet subscribed
        self._decoder = msgspec.msgpack.Decoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmove-vllm-events",
                                        daemon=True)
        self._thread.start()

    @property
    def subscribed(self) -> set[str]:
        with self.lock:
            return set(self._blocks)

    def subscribe(self, instance: str, endpoint: str) -> None:
        with self.lock:
            self._blocks.setdefault(instance, _Blocks())
            self._new.append((instance, endpoint))
        log.info("KV routing: %s's KV events from %s", instance, endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def block_size(self, instance: str) -> int | None:
        with self.lock:
            blocks = self._blocks.get(instance)
            return blocks.block_size if blocks else None

    def _run(self) -> None:
        context: zmq.Context = zmq.Context.instance()
        sockets: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                with self.lock:
                    new, self._new = self._new, []
                for instance, endpoint in new:
                    socket = context.socket(zmq.SUB)
                    socket.setsockopt(zmq.SUBSCRIBE, b"")
                    socket.connect(endpoint)
                    sockets[socket] = instance
                    poller.register(socket, zmq.POLLIN)
                for socket, _ in poller.poll(POLL_MS) if sockets else ():
                    parts = socket.recv_multipart()
                    self.apply(sockets[socket], parts[-1])
        finally:
            for socket in sockets:
                socket.close(linger=0)

    def apply(self, instance: str, payload: bytes) -> None:
        """One published batch (``[ts, events, dp_rank]``, each event a map with its
        ``type``); a malformed one is logged and dropped."""
        try:
            batch = self._decoder.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError, KeyError) as error:
            log.warning("KV routing: a malformed event batch from %s dropped: %s", instance,
                        error)
            return
        with self.lock:
            blocks = self._blocks.setdefault(instance, _Blocks())
            for event in events:
                if isinstance(event, dict):
                    self._apply_one(instance, blocks, event)

    def _apply_one(self, instance: str, blocks: _Blocks, event: dict) -> None:
        kind, medium = event.get("type"), event.get("medium") or "GPU"
        if kind == "AllBlocksCleared":
            self.index.clear(instance, "cache")
            for media in blocks.media.values():
                media.discard("GPU")
            return
        if medium not in MEDIA:
            return
        hashes = list(event.get("block_hashes") or ())
        if kind == "BlockStored":
            size, tokens = int(event.get("block_size") or 0), list(event.get("token_ids") or ())
            parent = event.get("parent_block_hash")
            chained = blocks.ours.get(parent) if parent is not None else None
            if size <= 0 or len(tokens) != size * len(hashes) or (parent is not None
                                                                  and chained is None):
                return   # partial blocks, or a parent never heard of: not indexed
            blocks.block_size = size
            for theirs, ours in zip(hashes, block_hashes(tokens, size, chained)):
                blocks.ours[theirs] = ours
                blocks.media.setdefault(theirs, set()).add(medium)
                self.index.add(instance, MEDIA[medium], (ours,))
        elif kind == "BlockRemoved":
            for theirs in hashes:
                held = blocks.media.get(theirs, set())
                if medium not in held:
                    continue
                held.discard(medium)
                if not any(MEDIA[m] == MEDIA[medium] for m in held):
                    self.index.discard(instance, MEDIA[medium], (blocks.ours[theirs],))
                if not held:
                    del blocks.media[theirs], blocks.ours[theirs]

    def counts(self, instance: str) -> dict[str, int]:
        with self.lock:
            return {m: self.index.num_blocks(instance, m) for m in ("cache", "store")}


def score(subscriber: EventSubscriber, instances: Sequence[Any], tokens: Sequence[int],
          placements: Sequence[Placement]) -> tuple[Decision, list[int]]:
    """The instance for a prompt of ``tokens`` among ``instances`` (each with ``url`` and
    ``in_flight``; ties go to the first), and the prompt's block hashes: ``choose`` over what
    each instance's events say it holds and the requests placed on it."""
    sizes = [s for i in instances if (s := subscriber.block_size(i.url)) is not None]
    size = min(sizes) if sizes else None
    hashes = prefix_hashes(list(tokens), size) if size else []
    candidates = []
    with subscriber.lock:
        for instance in instances:
            placed = [p for p in placements if p.instance == instance.url]
            coming = set().union(*(p.hashes for p in placed))
            matched, stored = (subscriber.index.match(instance.url, hashes, coming)
                               if subscriber.block_size(instance.url) == size else (0, 0))
            candidates.append(Candidate(
                instance.url, cached_tokens=(matched - stored) * (size or 0),
                stored_tokens=stored * (size or 0),
                pending_tokens=sum(p.uncached for p in placed), load=instance.in_flight))
    return choose(candidates, len(tokens)), hashes
