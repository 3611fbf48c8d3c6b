"""Continuous batching over a kvmove ``BlockPool``: each step re-forms the batch.

Every step, in order:

1. the running requests (decodes, and prefills still in chunks), oldest first, each taking
   what it needs (one token, or its next chunk) from the step's token budget. A request that
   needs a new block and finds none preempts the newest running request (its blocks freed,
   back to the front of the queue, to be recomputed) until it fits;
2. waiting requests, first come first served, while the token budget, the sequence limit and
   the free blocks allow. A new request first takes the longest cached prefix of its prompt
   (``BlockPool.match``) and computes only the rest. ``allocate`` returning None is
   back-pressure: the request waits, never dropped. With a ``PrefixStore``, the blocks past
   the live prefix that the KVStore holds are fetched first (the request steps out of the
   queue meanwhile, see ``prefix_store.py``).

After the forward pass, ``update`` advances each request and tags its newly full blocks with
their hashes (``BlockPool.commit``), so that a later request with the same prefix finds them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvmove.block_pool import BlockPool, block_hashes, prefix_hashes
from kvmove.engine.prefix_store import PrefixStore
from kvmove.engine.request import Request, RequestState
from kvmove.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["BatchScheduler", "Scheduled", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits. ``chunk_size`` splits long prefills across steps (None: whole prompts).
    ``hash_seed``: the block hashes' seed (``kvmove.block_hashes``): 0, or a deployment's
    secret (``DeploymentKey.hash_seed()``) so that no one can engineer colliding prefixes."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int | None = 512
    prefix_caching: bool = True
    hash_seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or
                                            not isinstance(self.chunk_size, int) or
                                            self.chunk_size < 1):
            raise ConfigError(f"chunk_size must be a positive int or None, got "
                              f"{self.chunk_size!r}")


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A request's part of one step: ``num_tokens`` from ``request.num_computed`` on."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This step computes the request's last known token, so it samples the next one."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class BatchScheduler:
    """One engine instance's continuous batching (the module's docstring says how a step's
    batch is formed). Named for its side: the vLLM connector has schedulers of its own."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int,
                 store: PrefixStore | None = None) -> None:
        if store is not None and not config.prefix_caching:
            raise ConfigError("a KV store needs prefix_caching (its keys are the block hashes)")
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.store = store
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # --- requests in and out --------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def check_fits(self, request: Request) -> None:
        """A request that could never fit, even alone, is refused up front (it would wait
        forever otherwise)."""
        need = self.blocks_for(len(request.prompt) + request.params.max_tokens)
        if need > self.pool.num_blocks:
            raise ConfigError(f"request {request.id!r} needs up to {need} blocks "
                              f"({len(request.prompt)} prompt + {request.params.max_tokens} "
                              f"new tokens), the cache has {self.pool.num_blocks}")

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV is already in its blocks (decode role, after the load)."""
        request.state = RequestState.RUNNING
        self.running.append(request)

    def remove(self, request: Request, free: bool = True) -> None:
        """Takes a request out of the batch; frees its blocks unless ``free`` is False (the
        caller keeps them, e.g. while they stream out). A finished request's full blocks are
        offered to the store first."""
        if self.store is not None and self.store.cancel(request):
            pass  # its fetched blocks come back when the store is done with them
        elif request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free:
            if request.finished:
                self.offer(request)
            self._release(request)

    def offer(self, request: Request) -> None:
        """Offers a request's full blocks to the store (when there is one)."""
        if self.store is not None:
            self.store.offer(request)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or (self.store and self.store.fetching))

    # --- one step -------------------------------------------------------------------------

    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        batch: list[Scheduled] = []
        if self.store is not None:
            self.waiting.extendleft(reversed(self.store.poll()))
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, budget)
            if self._grow(request, request.num_computed + n):
                batch.append(Scheduled(request, n))
                budget -= n
                i += 1
                continue
            victim = self.running[-1]  # the newest: the least work lost
            self._preempt(victim)
            batch = [s for s in batch if s.request is not victim]
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not request.blocks and self.config.prefix_caching and \
                    self._match_prefix(request):
                self.waiting.popleft()  # fetching from the store: back when it ends
                continue
            n = self._chunk(request, budget)
            if not self._grow(request, request.num_computed + n):
                self._release(request)  # do not sit on matched blocks while queued
                break
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            self.running.append(request)
            batch.append(Scheduled(request, n))
            budget -= n
        return batch

    def update(self, batch: Iterable[Scheduled]) -> None:
        """After the forward pass (and sampling): the scheduled tokens are in the cache."""
        for s in batch:
            s.request.num_computed += s.num_tokens
            if self.config.prefix_caching:
                self._commit(s.request)

    # --- blocks ---------------------------------------------------------------------------

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_uncomputed, budget)
        return min(n, self.config.chunk_size) if self.config.chunk_size else n

    def _grow(self, request: Request, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(request.blocks)
        if need <= 0:
            return True
        ids = self.pool.allocate(need)
        if ids is None:
            return False
        request.blocks += ids
        return True

    def _release(self, request: Request) -> None:
        if request.blocks:
            self.pool.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.hashes = []

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        # info, not warning: preemption is how a full cache makes room, but a stream of them
        # means the cache is too small for the load (each one recomputes a prompt).
        logger.info("preempted request %r to free its blocks (its preemption %d; %d in all)",
                    request.id, request.num_preemptions, self.num_preemptions)

    def _match_prefix(self, request: Request) -> bool:
        """Takes the longest cached prefix, leaving at least one token to compute (its
        logits give the next token), then asks the store for more. True when a fetch from the
        store started."""
        hashes = prefix_hashes(request.tokens, self.block_size, self.config.hash_seed)
        if not hashes:
            return False
        usable = len(hashes)
        ids = self.pool.match(hashes)
        if ids:
            request.blocks = list(ids)
            request.num_computed = len(ids) * self.block_size
            request.hashes = list(hashes[:len(ids)])
            request.num_cached += min(request.num_computed, len(request.prompt))
        return self.store is not None and len(ids) < usable and \
            self.store.fetch(request, hashes)

    def _commit(self, request: Request) -> None:
        """Tags the newly full blocks, chaining from the last tagged one (each token is hashed
        once per request)."""
        done, full = len(request.hashes), request.num_computed // self.block_size
        if full <= done:
            return
        b = self.block_size
        hashes = block_hashes(request.tokens[done * b:full * b], b,
                              request.hashes[-1] if request.hashes else None,
                              seed=self.config.hash_seed)
        self.pool.commit(request.blocks[done:full], hashes)
        request.hashes += hashes


