"""kvmove as a vLLM KV connector (vLLM's ``KVConnectorBase_V1``), loaded by module path::

    --kv-transfer-config '{"kv_connector": "KVMoveConnector",
                           "kv_connector_module_path": "kvmove.integrations.vllm",
                           "kv_role": "kv_producer", "kv_port": 5600}'

``kv_role`` picks what it does (docs/vllm.md):

- ``kv_producer`` / ``kv_consumer``: prefill/decode disaggregation over kvmove agents,
  speaking vLLM's P/D protocol (``kv_transfer_params``), so proxies written for vLLM's own
  NixlConnector work unchanged. ``pd.py``.
- ``kv_both``: offload to a ``kvmove.KVStore`` (host and disk tiers) keyed by vLLM's block
  hashes; a repeated prefix loads instead of being prefilled again. ``offload.py``.

vLLM builds one connector per role: the scheduler's (in the engine core) decides and tells the
workers what to do in each step's metadata; the worker's (beside the model) moves the bytes.
This module only picks the implementation and hands every call to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvmove.integrations.vllm.config import ConnectorConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVMoveConnector"]


class KVMoveConnector(KVConnectorBase_V1):
    """vLLM's view of kvmove: one class, two sides (scheduler and worker), two jobs (P/D by
    ``kv_producer``/``kv_consumer``, offload by ``kv_both``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_vllm(vllm_config)
        self.config = config
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            if config.offload:
                from kvmove.integrations.vllm.offload import Scheduler
            else:
                from kvmove.integrations.vllm.pd import Scheduler  # type: ignore[assignment]
            self._scheduler = Scheduler(vllm_config, config, kv_cache_config)
        else:
            if config.offload:
                from kvmove.integrations.vllm.offload import Worker
            else:
                from kvmove.integrations.vllm.pd_worker import Worker  # type: ignore[assignment]
            self._worker = Worker(vllm_config, config, kv_cache_config)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._scheduler.get_loaded_kv_cache_group_ids(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_work()

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # The bound metadata: vLLM may call start_load_kv only after the forward pass.
        self._worker.save_kv_layer(layer_name, kv_layer, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        # Offload reports its store's changes to the scheduler's index; P/D may not need to.
        build = getattr(self._worker, "build_connector_worker_meta", None)
        return None if build is None else build()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
