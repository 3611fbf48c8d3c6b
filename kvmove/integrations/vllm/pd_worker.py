"""Prefill/decode disaggregation in vLLM over kvmove: the worker side (the scheduler side is
``pd_scheduler.py``).

One ``kvmove.Agent`` per worker wraps vLLM's own KV tensors (``KVCache.wrap``: no copy, each
tensor registered once). The prefill's agent listens on ``kv_port`` + its tensor-parallel
rank (+ ``dp_rank * tp_size`` for a data-parallel engine, as NixlConnector's side channel); a
decode's agent connects to it the first time it loads from it.

``PDWorker`` composes the two parts and hands each of vLLM's calls to the part it concerns:
``PDPrefillWorker`` (``pd_prefill.py``: pushes, holds and sends) and ``PDDecodeWorker``
(``pd_decode.py``: loads). Both parts exist whatever ``kv_role`` says (it decides only whether
the agent listens), because what a request asks for is in its ``kv_transfer_params``, not in
the role: a step's metadata may carry loads, pushes and sends at once, and the two parts
share nothing but the agent, the pool and one lock.

The hand-off's messages are kvmove's stream protocol's: the decode offers its lease
(``Agent.offer``), the prefill streams into it or declines it (``Agent.decline``).

Threads: vLLM's model thread calls ``start_load_kv``/``save_kv_layer``/``wait_for_save``/
``get_finished``; one thread of ours receives the offers (the prefill part's); a small pool
runs the decode's loads and waits for the prefill's sends. One lock (a re-entrant condition,
notified when a transfer ends) guards both parts' state; nothing blocking runs under it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import kvmove
from kvmove.auth import key_from_file
from kvmove.integrations.vllm.config import (
    ConnectorConfig,
    KVRole,
    layout_of,
    total_kv_heads_of,
    wrap_kv_caches,
)
from kvmove.integrations.vllm.pd_decode import PDDecodeWorker
from kvmove.integrations.vllm.pd_prefill import PDPrefillWorker
from kvmove.integrations.vllm.tally import Tally
from kvmove.runtime import unpin, unpinned

if TYPE_CHECKING:
    from kvmove.integrations.vllm.pd_scheduler import PDMetadata

__all__ = ["PDWorker", "layer_ready_event"]

logger = logging.getLogger("vllm.kvmove.pd_worker")  # vLLM's handlers print "vllm.*"

# vLLM steps without pause while a request waits for its KV (or holds it for a decode), one
# empty step after the other: an idle step's get_finished waits this long for a transfer to
# end (it returns at once when one does), so the wait does not spin a core.
IDLE_WAIT_SECONDS = 0.02


def layer_ready_event(kv_layer: Any) -> Any:
    """What marks ``kv_layer`` written: on a GPU, a CUDA event recorded now on the tensor's
    device's current stream (the forward pass queued the kernels that write the layer there,
    and may not have run them yet); None for host memory, written when vLLM calls us.
    ``kv_layer`` is a tensor, or a sequence of tensors (K and V) for some backends."""
    first = kv_layer[0] if isinstance(kv_layer, (list, tuple)) and kv_layer else kv_layer
    if not getattr(first, "is_cuda", False):
        return None
    import torch  # only for CUDA tensors: vLLM loaded it already

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(first.device))
    return event


class PDWorker:
    """The worker side of ``KVMoveConnector`` for ``kv_producer``/``kv_consumer``."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, kv_cache_config: Any) -> None:
        self.config = config
        self.layout = layout_of(vllm_config)
        self.total_kv_heads = total_kv_heads_of(vllm_config)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.agent: kvmove.Agent | None = None
        self.layer_index: dict[str, int] = {}
        self._lock = threading.Condition()  # re-entrant; notified when a transfer ended
        self._idle = False
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvmove-vllm", initializer=unpin)
        self._prefill: PDPrefillWorker | None = None
        self._decode: PDDecodeWorker | None = None
        self.tally = Tally()   # both parts count into it; vLLM takes it after each step

    @property
    def prefill(self) -> PDPrefillWorker:
        assert self._prefill is not None, "register_kv_caches has not run"
        return self._prefill

    @property
    def decode(self) -> PDDecodeWorker:
        assert self._decode is not None, "register_kv_caches has not run"
        return self._decode

    # ---- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        cache = wrap_kv_caches(kv_caches, self.layout)
        cfg = self.config
        with unpinned():   # the agent's threads, its listener's and ours
            self.agent = self._start_agent(cache)
            self._prefill = PDPrefillWorker(self.agent, len(kv_caches), cfg.lease_seconds,
                                            cfg.load_timeout, self._lock, self._pool,
                                            tally=self.tally)
            self._decode = PDDecodeWorker(self.agent, cfg.load_timeout, self._lock, self._pool,
                                          tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
                                          total_kv_heads=self.total_kv_heads,
                                          staging_blocks=self._staging_blocks(cache),
                                          agent_kwargs=self._agent_kwargs(),
                                          tally=self.tally)
            self._prefill.start()
        listening = cfg.serves_prefill
        logger.info("kvmove: %s agent %s over %d layers of %s (%s)%s", self._side,
                    self.agent.name, len(kv_caches), self.layout, cache.device,
                    f", listening on {cfg.host}:{cfg.listen_port}" if listening else "")

    @property
    def _side(self) -> str:
        return {KVRole.PRODUCER: "prefill", KVRole.CONSUMER: "decode"}.get(self.config.role,
                                                                         "pd")

    def _staging_blocks(self, cache: kvmove.KVCache) -> int:
        """Staging blocks per prefill rank of another TP: ``staging_blocks``, else room for
        two of the longest requests (``max_model_len``), at most a quarter of the cache's."""
        if self.config.staging_blocks:
            return int(self.config.staging_blocks)
        longest = -(-self.max_model_len // self.layout.block_size)
        return max(1, min(2 * longest, cache.num_blocks // 4))

    def _agent_kwargs(self) -> dict[str, Any]:
        """This worker's agents' settings (its own and its staging areas')."""
        cfg = self.config
        key = key_from_file(cfg.key_file).secret if cfg.key_file else None
        return {"transports": cfg.transports, "checksums": cfg.checksums, "key": key,
                "host": cfg.host, "net_devices": cfg.net_devices}

    def _start_agent(self, cache: kvmove.KVCache) -> kvmove.Agent:
        """This rank's agent, declaring the KV heads it holds (``tp.rank_heads``): a peer
        holding other heads is refused before any byte moves."""
        cfg = self.config
        dp = f"dp{cfg.dp_rank}-" if cfg.dp_rank else ""
        first = cfg.tp_rank * cache.layout.num_kv_heads
        heads = (first, self.total_kv_heads) if self.total_kv_heads % cfg.tp_size == 0 else None
        agent = kvmove.Agent(f"vllm-{self._side}-{cfg.engine_id}-{dp}{cfg.tp_rank}", cache,
                             kv_heads=heads, **self._agent_kwargs())
        if cfg.serves_prefill:
            agent.listen(cfg.host, cfg.listen_port)
        return agent

    def shutdown(self) -> None:
        if self._prefill is not None:
            self._prefill.close()
        if self._decode is not None:
            self._decode.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.agent is not None:
            self.agent.close()

    # ---- vLLM's model thread ----------------------------------------------------------------

    def start_load_kv(self, meta: PDMetadata) -> None:
        # vLLM 0.32 calls this after the forward pass when no load is synchronous: the pushes
        # of this step began at its first save_kv_layer already (begin_step is idempotent).
        self.decode.start(meta.loads)
        with self._lock:
            self._idle = meta.idle and not meta.loads
            self.prefill.begin_step(meta)
            for send in meta.sends:
                self.prefill.hold(send)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before vLLM schedules the request (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: PDMetadata) -> None:
        """Layer ``layer_name``'s KV is in vLLM's blocks (on a GPU: once the kernels queued so
        far ran): post it to every decode already waiting for a request of this forward pass
        (the others get it once they ask). The post waits for the layer's CUDA event, never
        this thread for the GPU."""
        if meta.pushes:
            self.prefill.save_layer(meta, self.layer_index[layer_name],
                                    layer_ready_event(kv_layer))

    def wait_for_save(self) -> None:
        self.prefill.end_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        prefill, decode = self.prefill, self.decode
        with self._lock:
            if self._idle and not (prefill.has_sent or decode.has_received) and \
                    (decode.pending or prefill.pending):
                self._lock.wait(IDLE_WAIT_SECONDS)
            prefill.release_expired(time.monotonic())
            sent, received = prefill.take_sent(), decode.take_received()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.decode.take_load_errors()

    def build_connector_worker_meta(self) -> None:
        return None   # the scheduler side needs no report from P/D workers

    def take_stats(self) -> dict[str, Any] | None:
        """What the hand-offs did since the last call (``tally.py``), with the counters of
        this rank's agents (its own and its staging areas')."""
        return self.tally.take(self.decode.agents if self._decode is not None else ())
