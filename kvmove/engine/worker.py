"""An engine instance: a model, its paged KV cache in kvmove memory, a scheduler, and a role.

* ``colocated``: prefill and decode in one batch, the baseline whose decode steps stall
  behind long prefills.
* ``prefill``: computes prompts (in chunks) and streams each request's KV layer by layer into
  the blocks its decode worker leased and offered (``save_layer`` is the model's per-layer
  hook; ``prefill_handoff.py``), sends the first sampled token with the final message (and
  when its last layer was computed: the hand-off's timeline), and frees its blocks once the
  decode side acknowledged it.
* ``decode``: ``reserve`` blocks for an incoming request (None when full: back-pressure),
  ``start_load`` leases them to the prefill worker and offers it the lease (``Agent.offer``:
  the epoch and the ids go by kvmove, not by the router), and once the KV is in, decode it in
  the batch until EOS, ``max_tokens`` or a stop string. A load that fails, times out or is
  aborted gives its blocks back only once its lease is released: no late write from the
  prefill can reach a block reused meanwhile.

Colocated and prefill workers may keep a ``KVStore`` (host and disk tiers): the prefixes it
holds are loaded instead of prefilled, and finished requests' blocks are offered to it
(``prefix_store.py``).

``step()`` runs one scheduler step and one forward pass, and returns the requests that ended
in it (for ``prefill``: handed off). Everything is synchronous and single-threaded; kvmove's
own threads move the bytes. A decode worker looks for completed loads between the layers of
its forward pass too: a request's first token (it came with the KV) goes out then, not a
whole decode step later.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from kvmove.agent import Agent
from kvmove.block_pool import BlockPool
from kvmove.engine.detokenizer import Detokenizer
from kvmove.engine.model import LlamaForCausalLM, SeqChunk
from kvmove.engine.prefill_handoff import BOOT_ID, FINAL, PrefillHandoffs
from kvmove.engine.prefix_store import PrefixStore
from kvmove.engine.request import FinishReason, Request, RequestState
from kvmove.engine.role import ROLES, Role
from kvmove.engine.sampling import sample, skip_draw
from kvmove.engine.scheduler import BatchScheduler, SchedulerConfig
from kvmove.engine.tokenizer import load_tokenizer
from kvmove.errors import ConfigError, KVMoveError
from kvmove.kv_cache import KVCache
from kvmove.runtime import unpinned
from kvmove.store import KVStore
from kvmove.stream import LoadStream, SaveStream, StreamState

logger = logging.getLogger(__name__)

__all__ = ["ROLES", "EngineWorker"]

_IDLE_WAIT = 0.001  # seconds an idle step waits for a fetch from the store


class EngineWorker:
    """One engine instance.

    Args:
        model: the model (its config gives the KV layout).
        role: a ``Role`` (or its string, one of ``ROLES``).
        num_blocks: KV cache size in blocks of ``block_size`` tokens.
        scheduler: batch limits, chunked prefill, prefix caching.
        tokenizer: decodes output for stop strings (``decode_stream()``); None: the byte
            tokenizer when the model's special ids allow it (``load_tokenizer``), else none,
            and stop strings are refused.
        name: the kvmove agent's name (prefill and decode roles).
        agent_kwargs: passed to ``kvmove.Agent`` (``transports``, ``error_mode``...).
        transfer_timeout: seconds a KV hand-off may take before it is abandoned.
        on_token: called with (request, token) for every token sampled (or received with the
            KV), as it happens: how a server streams tokens out.
        store: KV storage tiers under the cache (colocated and prefill roles; the caller owns
            and closes it): stored prefixes are loaded instead of prefilled when the store
            decides that is faster, finished requests' full blocks are offered to it.
    """

    def __init__(self, model: LlamaForCausalLM, *, role: Role | str = Role.COLOCATED,
                 num_blocks: int = 1024, block_size: int = 16,
                 scheduler: SchedulerConfig | None = None, tokenizer: Any = None,
                 name: str | None = None, agent_kwargs: dict[str, Any] | None = None,
                 transfer_timeout: float = 60.0,
                 on_token: Callable[[Request, int], None] | None = None,
                 store: KVStore | None = None) -> None:
        if role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
        if store is not None and role == Role.DECODE:
            raise ConfigError("a decode worker does not prefill: give the store to the "
                              "prefill (or colocated) workers")
        self.model = model
        self.role = Role(role)
        self.tokenizer = tokenizer if tokenizer is not None else _default_tokenizer(model)
        self.transfer_timeout = transfer_timeout
        self.on_token = on_token
        self.cache = KVCache(model.config.kv_spec(block_size), num_blocks)
        assert self.cache.pool is not None  # a cache kvmove allocates has its pool
        self.pool: BlockPool = self.cache.pool
        self.kv = self.cache.torch()
        self.store = PrefixStore(store, self.cache) if store is not None else None
        self.scheduler = BatchScheduler(scheduler or SchedulerConfig(), self.pool, block_size,
                                        self.store)
        agent = None
        if role != Role.COLOCATED:
            with unpinned():  # its threads are not confined to a pinned model thread's cores
                agent = Agent(name or f"{role}-worker", self.cache, **(agent_kwargs or {}))
        self.agent = agent
        self.handoffs = PrefillHandoffs(agent, transfer_timeout,
                                        self.cache.layout.bytes_per_block) \
            if agent is not None and self.role == Role.PREFILL else None
        self.loading: dict[str, tuple[Request, LoadStream]] = {}   # decode: KV coming in
        self._releasing: list[tuple[LoadStream, list[int]]] = []  # decode: freed once released
        self.num_steps = 0

    # --- requests in ----------------------------------------------------------------------

    def add_request(self, request: Request, *, decode_peer: str | None = None) -> None:
        """Queues a request (colocated and prefill roles). A prefill worker also needs the
        decode worker's agent its KV goes to: that worker offers the blocks it leased for it
        (``start_load`` there), by kvmove."""
        if self.role == Role.DECODE:
            raise ConfigError("a decode worker takes requests through reserve()/start_load()")
        self._check(request)
        if self.handoffs is not None:
            if not decode_peer:
                raise ConfigError(f"a prefill worker needs the decode_peer its KV goes to for "
                                  f"request {request.id!r}, got {decode_peer!r}")
            self.handoffs.expect(request, decode_peer)
        self.scheduler.add(request)

    def reserve(self, request: Request) -> list[int] | None:
        """Decode role: blocks for the request's prompt KV, or None while the cache is full."""
        if self.role != Role.DECODE:
            raise ConfigError("only a decode worker reserves blocks for incoming KV")
        self._check(request)
        ids = self.pool.allocate(self.scheduler.blocks_for(len(request.prompt)))
        if ids is not None:
            request.blocks = ids
            request.state = RequestState.LOADING
        return ids

    def start_load(self, request: Request, prefill_peer: str) -> None:
        """Decode role: lease the request's reserved blocks to ``prefill_peer`` for
        ``transfer_timeout`` seconds, offer them to it (``Agent.offer``) and receive its KV
        into them; it joins the decode batch once everything is in. When the offer cannot be
        made (the prefill worker is gone), the blocks go back and the error is raised."""
        if not request.blocks:
            raise ConfigError(f"request {request.id!r} has no reserved blocks: reserve() first")
        assert self.agent is not None  # a decode worker (reserve() refused the others) has one
        try:
            load = self.agent.offer(prefill_peer, request.id, request.blocks,
                                    timeout=self.transfer_timeout)
        except KVMoveError:
            self.pool.free(request.blocks)  # nobody was offered them: free at once
            request.blocks = []
            raise
        assert load is not None  # offer() gives None only for no blocks, refused above
        request.timings.kv_start = time.monotonic()
        self.loading[request.id] = (request, load)

    def _check(self, request: Request) -> None:
        if request.params.stop and self.tokenizer is None:
            raise ConfigError(f"request {request.id!r} has stop strings, and this worker has no "
                              "tokenizer to find them with")
        self.scheduler.check_fits(request)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.has_work or self.loading or self._releasing or
                    (self.handoffs is not None and self.handoffs.has_work))

    @property
    def sending(self) -> dict[str, tuple[Request, SaveStream]]:
        """Prefill role: the requests whose KV streams out now (empty for the others)."""
        return self.handoffs.sending if self.handoffs is not None else {}

    def abort(self, request_id: str) -> Request | None:
        """Drops a request wherever it is (queued, in the batch, its KV streaming in or out);
        its blocks come back (a load's once its lease is released: the sender was told to stop
        and may still write them until it answers). Returns it, finished with ``abort``, or
        None when it is not here."""
        request: Request | None  # narrowed to Request in each branch that goes on
        if request_id in self.loading:
            request, load = self.loading.pop(request_id)
            load.cancel()
            self._releasing.append((load, request.blocks))
        elif self.handoffs is not None and (held := self.handoffs.abort(request_id)):
            if request_id in self.sending:
                return held  # polling frees the blocks once the posted layers landed
            request = held   # its offer was late: its blocks go back now
            self.pool.free(request.blocks)
        else:
            fetching = [f.request for f in self.store.fetching] if self.store else []
            request = next((r for r in [*self.scheduler.running, *self.scheduler.waiting,
                                        *fetching] if r.id == request_id), None)
            if request is None:
                return None
            self.scheduler.remove(request)
        request.blocks = []
        request.finish(FinishReason.ABORT, "aborted")
        return request

    # --- one step -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One scheduler step and forward pass; returns the requests that ended."""
        ended = self._poll_transfers()
        batch = self.scheduler.schedule()
        if not batch:
            if self.store is not None:
                self.store.wait_fetch(_IDLE_WAIT)  # rather than spin while the store reads
            return ended
        self.num_steps += 1
        # A prefill worker hands off every request whose prompt ends in this pass: those whose
        # offer is here stream each layer as it is written, the others (late offers) stream
        # every layer once their offer comes; either's hand-off starts at its last layer.
        handing: list[Request] = []
        streams: list[tuple[Request, SaveStream]] = []
        if self.handoffs is not None:
            handing = [s.request for s in batch if s.samples]
            streams = self.handoffs.open(handing)
        hook = None
        if handing:
            last = self.model.config.num_layers - 1

            def hook(layer: int) -> None:
                if layer == last:
                    now = time.monotonic()
                    for request in handing:
                        request.timings.last_layer = now
                for _, stream in streams:
                    try:
                        stream.save_layer(layer)
                    except KVMoveError:
                        pass  # the stream failed (its peer died): polling ends the request
        elif self.loading:
            def hook(layer: int) -> None:
                # A load that completed during this pass has its first token out now, not
                # after the pass (up to a decode step later); it joins the batch next step.
                ended.extend(self._poll_loading(time.monotonic()))
        seqs = [SeqChunk(s.request.tokens[s.request.num_computed:
                                          s.request.num_computed + s.num_tokens],
                         s.request.num_computed, s.request.blocks) for s in batch]
        began = time.monotonic()
        for s in batch:
            if s.request.timings.first_step is None:
                s.request.timings.first_step = began
        start = time.perf_counter()
        logits = self.model(seqs, self.kv, hook)
        if self.store is not None:
            self.store.observe(sum(s.num_tokens for s in batch), time.perf_counter() - start)
        sampling = [(i, s) for i, s in enumerate(batch) if s.samples]
        tokens = sample(logits[[i for i, _ in sampling]], [s.request for _, s in sampling])
        self.scheduler.update(batch)
        now = time.monotonic()
        for (_, s), token in zip(sampling, tokens):
            ended += self._emit(s.request, token, now)
        return ended

    def run(self, max_steps: int = 1_000_000) -> list[Request]:
        """Steps until nothing is left to do; returns every request that ended."""
        ended: list[Request] = []
        for _ in range(max_steps):
            if not self.has_work:
                return ended
            ended += self.step()
        raise ConfigError(f"still busy after {max_steps} steps")

    def _emit(self, request: Request, token: int, now: float) -> list[Request]:
        request.output.append(token)
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.tokens.append(now)
        if self.on_token is not None and self.role != Role.PREFILL:
            self.on_token(request, token)
        if self.handoffs is not None:
            self.scheduler.remove(request, free=False)  # the blocks stream out until acked
            request.state = RequestState.HANDING_OFF
            if self.handoffs.first_token(request, token):
                return []
            self.pool.free(request.blocks)  # its stream could not open
            request.blocks = []
            request.finish(FinishReason.ABORT, request.error)
            return [request]
        reason = self._stop_reason(request, token)
        if reason is None:
            return []
        request.finish(reason)
        self.scheduler.remove(request)
        return [request]

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """Why ``token`` ends the request, if it does; a request that ends has its ``text``
        (cut before a stop string). The text grows one token at a time (``Detokenizer``):
        decoding the whole output again every step made a request's cost quadratic."""
        params = request.params
        texts = self._detokenizer(request)
        if texts is not None:
            texts.push(token)
            if texts.stopped:
                request.text = texts.text
                return FinishReason.STOP
        reason = None
        if not params.ignore_eos and token == self.model.config.eos_token_id:
            reason = FinishReason.STOP
        elif len(request.output) >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and texts is not None:
            texts.flush()
            request.text = texts.text
        return reason

    def _detokenizer(self, request: Request) -> Detokenizer | None:
        if self.tokenizer is None:
            return None
        if request.detokenizer is None:
            request.detokenizer = Detokenizer(self.tokenizer, request.params.stop)
        return request.detokenizer

    # --- KV hand-offs ---------------------------------------------------------------------

    def _poll_transfers(self) -> list[Request]:
        now = time.monotonic()
        ended = self._poll_sending(now) + self._poll_loading(now)
        kept = []
        for load, blocks in self._releasing:
            if load.released:  # no byte of its stream can land any more
                self.pool.free(blocks)
            else:
                kept.append((load, blocks))
        self._releasing = kept
        return ended

    def _poll_sending(self, now: float) -> list[Request]:
        """Prefill role: the hand-offs that ended; their blocks go back (those handed off are
        offered to the store first)."""
        if self.handoffs is None:
            return []
        ended = self.handoffs.poll(now)
        for request in ended:
            if request.finish_reason == FinishReason.HANDED_OFF:
                self.scheduler.offer(request)
            self.pool.free(request.blocks)
            request.blocks = []
        return ended

    def _poll_loading(self, now: float) -> list[Request]:
        """Loads that ended: a complete one joins the batch; any other ends its request, and
        its blocks come back once the lease is released (the agent cancels a lease at its
        deadline, ``transfer_timeout``)."""
        ended = []
        for rid, (request, load) in list(self.loading.items()):
            state = load.state
            if state == StreamState.OPEN:
                continue
            del self.loading[rid]
            request.timings.kv_end = now
            if state == StreamState.DONE and len(load.payload) == FINAL.size:
                token, last_layer, boot_id = FINAL.unpack(load.payload)
                if boot_id == BOOT_ID != bytes(16) and not math.isnan(last_layer):
                    request.timings.last_layer = last_layer  # the prefill's, on our clock
                landed = [t for t in load.layer_times() if t is not None]
                request.timings.kv_landed = max(landed) if landed else None
                request.num_computed = len(request.prompt)
                skip_draw(request, self.model.config.vocab_size)  # the prefill's first token
                self.scheduler.add_running(request)
                ended += self._emit(request, token, now)
                continue
            if state == StreamState.DONE:  # released; but its final payload is not ours
                self.pool.free(request.blocks)
                request.finish(FinishReason.ABORT, f"the KV of {rid!r} came with a "
                               f"{len(load.payload)}-byte final payload, not {FINAL.size}")
                logger.warning("request %r: %s", rid, request.error)
                request.blocks = []
                ended.append(request)
                continue
            self._releasing.append((load, request.blocks))
            request.finish(FinishReason.ABORT, load.error or f"load {state.name}")
            logger.warning("request %r: KV load failed: %s", rid, request.error)
            request.blocks = []
            ended.append(request)
        return ended

    def close(self) -> None:
        """Waits (up to ``transfer_timeout``) for the store's fetches and offers, then closes
        the agent, whether or not the store finished in time."""
        try:
            if self.store is not None:
                self.store.drain(self.transfer_timeout)
        finally:
            if self.agent is not None:
                self.agent.close()


def _default_tokenizer(model: LlamaForCausalLM) -> Any:
    try:
        return load_tokenizer(None, model.config)
    except ConfigError:  # special ids among the bytes, or a vocabulary under 256
        return None
