"""Prefill/decode disaggregation in vLLM over kvmove: the scheduler side (``Scheduler``), and
the worker side (``Worker``, in ``pd_worker.py``).

The protocol is vLLM's (``kv_transfer_params``), so a proxy written for vLLM's NixlConnector
drives it unchanged:

1. The proxy sends the request to the prefill instance (``kv_producer``) with
   ``{"do_remote_decode": true}`` and ``max_tokens: 1``. When it finishes, ``request_finished``
   keeps its blocks (a lease of ``lease_seconds``) and returns the params the decode needs: its
   block ids, request id and kvmove address.
2. The proxy sends the request to the decode instance (``kv_consumer``) with those params.
   ``get_num_new_matched_tokens`` says the prompt's tokens arrive asynchronously; vLLM
   allocates blocks; the decode's worker leases them (``Agent.expect``) and asks the prefill's
   worker for the KV. The prefill streams it into the lease and then frees its blocks; the
   decode recomputes only the last prompt token and generates.

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

from kvmove.integrations.vllm.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["LoadSpec", "Metadata", "PushSpec", "Scheduler", "SendSpec"]

logger = init_logger("vllm.kvmove.pd")

PUSH = "push"
PULL = "pull"


@dataclass
class LoadSpec:
    """Decode side: load a request's prompt KV from a prefill instance into ``blocks``."""

    req_id: str
    key: str                   # the prefill's name for it: transfer id (push) or request id
    mode: str
    blocks: list[int]          # local blocks; empty: nothing to load, only release the prefill
    remote_host: str
    remote_port: int
    num_tokens: int


@dataclass
class SendSpec:
    """Prefill side: a finished request's blocks, held for the decode until ``deadline``
    (``time.monotonic()``, the same clock in every process of the host)."""

    req_id: str
    transfer_id: str | None
    blocks: list[int]
    deadline: float
    abort: bool = False        # the request did not finish normally: send nothing


@dataclass
class PushSpec:
    """Prefill side, push mode: this step's forward pass completes the request's prompt; its
    layers may stream to the decode's lease as they are saved."""

    req_id: str
    transfer_id: str
    blocks: list[int]


@dataclass
class Metadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)
    idle: bool = False         # the step computes nothing (vLLM polls for transfers)


def transfer_id(params: dict[str, Any] | None) -> str | None:
    """The push transfer id of a request's params, when it asks for push."""
    if not params or params.get("transfer_mode") != PUSH:
        return None
    tid = params.get("kvmove_transfer_id")
    return tid if isinstance(tid, str) and 0 < len(tid) <= 128 else None


class Scheduler:
    """Decides, per request, what the workers move; runs in vLLM's engine core."""

    def __init__(self, vllm_config: Any, config: ConnectorConfig, kv_cache_config: Any) -> None:
        self.config = config
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
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not _address(params):
            logger.warning("kvmove: request %s asks for a remote prefill without the "
                           "prefill's remote_host/remote_port; computing it here",
                           request.request_id)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            tid = transfer_id(params)
            if tid is not None and request.request_id not in self._pushing:
                self._pushing[request.request_id] = (tid, [])
                self._requests[request.request_id] = request
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one hand-off per request
        address = _address(params)
        if address is None:
            return
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        tid = transfer_id(params)
        key = tid if tid is not None else str(params.get("remote_request_id", ""))
        if not key:
            logger.warning("kvmove: request %s has no remote_request_id; not loading",
                           request.request_id)
            return
        self._loads.append(LoadSpec(request.request_id, key, PUSH if tid else PULL,
                                    list(local), address[0], address[1],
                                    num_external_tokens))

    # ---- both ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Metadata:
        meta = Metadata(loads=self._loads, sends=self._sends,
                        idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._loads, self._sends = [], []
        if self._pushing:
            self._collect_pushes(scheduler_output, meta)
        return meta

    def _collect_pushes(self, out: SchedulerOutput, meta: Metadata) -> None:
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

        params = request.kv_transfer_params
        req_id = request.request_id
        self._pushing.pop(req_id, None)
        self._requests.pop(req_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Never allocated (aborted while waiting): tell the prefill to let its blocks go.
            params["do_remote_prefill"] = False
            address, tid = _address(params), transfer_id(params)
            key = tid or str(params.get("remote_request_id", ""))
            if address and key:
                self._loads.append(LoadSpec(req_id, key, PUSH if tid else PULL, [],
                                            address[0], address[1], 0))
            return False, None
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
        # Held in every case: a push stream may be reading these blocks right now, and only
        # the worker knows when it has stopped (then it reports the request as sent).
        self._sends.append(SendSpec(req_id, transfer_id(params), list(block_ids),
                                    time.monotonic() + self.config.lease_seconds,
                                    abort=not normal))
        if not normal:
            return True, None
        return True, dict(
            do_remote_prefill=True, do_remote_decode=False,
            remote_block_ids=list(block_ids), remote_engine_id=self.config.engine_id,
            remote_request_id=req_id, remote_host=self.config.host,
            remote_port=self.config.port, tp_size=self.config.tp_size,
            remote_num_tokens=request.num_computed_tokens,
            transfer_mode=PUSH if transfer_id(params) else PULL)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(self.num_groups))

    def has_pending_work(self) -> bool:
        return False

    def shutdown(self) -> None:
        return


def _address(params: dict[str, Any]) -> tuple[str, int] | None:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or \
            not isinstance(port, int) or not 0 < port < 65536:
        return None
    return host, port

