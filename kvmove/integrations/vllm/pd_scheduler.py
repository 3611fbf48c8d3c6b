"""Prefill/decode disaggregation in vLLM over kvmove: the scheduler side (``PDScheduler``);
the worker side is ``PDWorker`` (``pd_worker.py``), the step metadata between them
``PDMetadata`` (its jobs in ``pd_specs.py``), the params ``params.py``.

The protocol is vLLM's (``kv_transfer_params``), so a proxy written for vLLM's NixlConnector
drives it unchanged:

1. The proxy sends the request to the prefill instance (``kv_producer``) with
   ``{"do_remote_decode": true}`` and ``max_tokens: 1``. When it finishes, ``request_finished``
   keeps its blocks (a lease of ``lease_seconds``) and returns the params the decode needs: its
   block ids, request id and kvmove address.
2. The proxy sends the request to the decode instance (``kv_consumer``) with those params.
   ``get_num_new_matched_tokens`` says the prompt's tokens arrive asynchronously; vLLM
   allocates blocks; the decode's worker leases them and offers the lease to the prefill's
   worker (``pd_decode.py``). The prefill streams the KV into it and then frees its blocks
   (``pd_prefill.py``); the decode recomputes only the last prompt token and generates.

kvmove's **push** mode (``"transfer_mode": "push"`` with a ``kvmove_transfer_id`` shared by
both requests) changes one thing: the proxy sends both requests at once, the decode leases its
blocks while the prefill computes, and the prefill streams each layer as ``save_kv_layer``
runs, so the hand-off overlaps the forward pass instead of following it.

Either way, the bytes move under kvmove's lease protocol (docs/streaming.md): the decode's
blocks are leased with an epoch and a deadline, the sender writes nothing before the receiver
said yes, and a cancelled or expired lease is never written into afterwards. A load that fails
is reported through ``get_block_ids_with_load_errors`` (run vLLM with
``"kv_load_failure_policy": "recompute"`` and it recomputes those blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger

from kvmove.bootstrap import advertised_host
from kvmove.integrations.vllm.config import ConnectorConfig
from kvmove.integrations.vllm.params import KVTransferParams, TransferMode, mark_handed_off
from kvmove.integrations.vllm.pd_specs import LoadSpec, PushSpec, SendSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["PDMetadata", "PDScheduler"]

logger = init_logger("vllm.kvmove.pd")


@dataclass
class PDMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one step: the jobs of ``pd_specs.py``."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)
    idle: bool = False         # the step computes nothing (vLLM polls for transfers)


class PDScheduler:
    """Decides, per request, what the workers move; runs in vLLM's engine core."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, kv_cache_config: Any) -> None:
        self.config = config
        # what decodes are told to connect to: the prefill agents' host, never a wildcard
        # (each worker's agent listens on host; a decode told "0.0.0.0" reached itself)
        self.advertised_host = (advertised_host(config.host) if config.serves_prefill
                                else config.host)
        self.block_size = vllm_config.cache_config.block_size
        self.num_groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config else 1
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []
        # Prefill side, push mode: request id -> (transfer id, blocks so far), until the step
        # that completes the prompt is scheduled.
        self._pushing: dict[str, tuple[str, list[int]]] = {}
        self._requests: dict[str, Request] = {}

    # ---- decode side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = KVTransferParams.from_request(request.kv_transfer_params)
        if not params.do_remote_prefill:
            return 0, False
        if params.agent_address is None:
            logger.warning("kvmove: request %s asks for a remote prefill without the "
                           "prefill's remote_host/remote_port; computing it here",
                           request.request_id)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = KVTransferParams.from_request(request.kv_transfer_params)
        if params.do_remote_decode:
            tid = params.transfer_id
            if tid is not None and request.request_id not in self._pushing:
                self._pushing[request.request_id] = (tid, [])
                self._requests[request.request_id] = request
            return
        if not params.do_remote_prefill:
            return
        mark_handed_off(request.kv_transfer_params)  # one hand-off per request
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._queue_load(request.request_id, params, list(local), num_external_tokens)

    def _queue_load(self, req_id: str, params: KVTransferParams, blocks: list[int],
                    num_tokens: int) -> None:
        """A load for the decode's worker (``blocks`` empty: only let the prefill's go)."""
        address = params.agent_address
        if address is None:
            return
        if params.key is None:
            logger.warning("kvmove: request %s has no remote_request_id; not loading", req_id)
            return
        self._loads.append(LoadSpec(req_id, params.key, params.mode, blocks, address[0],
                                    address[1], num_tokens, params.tp_size))

    # ---- both ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDMetadata:
        meta = PDMetadata(loads=self._loads, sends=self._sends,
                          idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._sends = [], []
        if self._pushing:
            self._collect_pushes(scheduler_output, meta)
        return meta

    def _collect_pushes(self, out: SchedulerOutput, meta: PDMetadata) -> None:
        steps: list[tuple[str, int, list[int] | None, bool]] = [
            (new.req_id, new.num_computed_tokens, new.block_ids[0], True)
            for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            steps.append((req_id, cached.num_computed_tokens[i], ids[0] if ids else None,
                          req_id in cached.resumed_req_ids))
        for req_id, computed, ids, replace in steps:
            if req_id not in self._pushing:
                continue
            tid, blocks = self._pushing[req_id]
            if ids is not None:
                blocks = list(ids) if replace else blocks + list(ids)
                self._pushing[req_id] = (tid, blocks)
            request = self._requests[req_id]
            scheduled = out.num_scheduled_tokens.get(req_id, 0)
            if computed + scheduled >= request.num_prompt_tokens:
                meta.pushes.append(PushSpec(req_id, tid, blocks))
                del self._pushing[req_id]
                del self._requests[req_id]

    def update_connector_output(self, connector_output: Any) -> None:
        return

    # ---- prefill side ----------------------------------------------------------------------

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        self._pushing.pop(req_id, None)
        self._requests.pop(req_id, None)
        params = KVTransferParams.from_request(request.kv_transfer_params)
        if params.do_remote_prefill:
            # Never allocated (aborted while waiting): tell the prefill to let its blocks go.
            mark_handed_off(request.kv_transfer_params)
            self._queue_load(req_id, params, [], 0)
            return False, None
        if not params.do_remote_decode or not block_ids:
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        # Held in every case: a push stream may be reading these blocks right now, and only
        # the worker knows when it has stopped (then it reports the request as sent).
        self._sends.append(SendSpec(req_id, params.transfer_id, list(block_ids),
                                    time.monotonic() + self.config.lease_seconds,
                                    abort=not normal))
        if not normal:
            return True, None
        return True, self._answer(request, block_ids, params.mode).to_dict()

    def _answer(self, request: Request, block_ids: list[int],
                mode: TransferMode) -> KVTransferParams:
        """What a finished prefill returns: where its decode gets the KV."""
        cfg = self.config
        return KVTransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=tuple(block_ids),
            remote_engine_id=cfg.engine_id, remote_request_id=request.request_id,
            remote_host=self.advertised_host, remote_port=cfg.engine_port, tp_size=cfg.tp_size,
            remote_num_tokens=request.num_computed_tokens, transfer_mode=mode)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(self.num_groups))

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> list[Any]:
        return []   # P/D keeps no tiers: vLLM's own events say what its cache holds

    def shutdown(self) -> None:
        return
