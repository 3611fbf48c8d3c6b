"""``KVMoveConnector``: kvmove as a vLLM KV connector (vLLM's ``KVConnectorBase_V1``).

vLLM builds one connector per role: the scheduler's (in the engine core) decides and tells the
workers what to do in each step's metadata; the worker's (beside the model) moves the bytes.
This class only picks the two sides for ``kv_role`` (``sides.py``: P/D or offload) and hands
every call to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvmove.integrations.vllm.config import ConnectorConfig
from kvmove.integrations.vllm.sides import ConnectorScheduler, ConnectorWorker
from kvmove.integrations.vllm.stats import KVMoveConnectorStats, KVMovePromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVMoveConnector"]


class KVMoveConnector(KVConnectorBase_V1):
    """vLLM's view of kvmove: one class, two sides (scheduler and worker), two jobs (P/D by
    ``kv_producer``/``kv_consumer``/``kv_both``, as NixlConnector; offload by ``kv_both`` with
    the ``offload`` setting)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_vllm(vllm_config)
        self.config = config
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _scheduler_class(config)(vllm_config, config, kv_cache_config)
        else:
            self._worker = _worker_class(config)(vllm_config, config, kv_cache_config)

    @property
    def scheduler(self) -> ConnectorScheduler:
        assert self._scheduler is not None, "a worker's connector has no scheduler side"
        return self._scheduler

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "the scheduler's connector has no worker side"
        return self._worker

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.scheduler.get_loaded_kv_cache_group_ids(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Offload: what kvmove's tiers stored and dropped, as vLLM's KV events
        (``kv_events.py``); published only with vLLM's ``--kv-events-config``."""
        return self.scheduler.take_events()

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # The bound metadata: vLLM may call start_load_kv only after the forward pass.
        self.worker.save_kv_layer(layer_name, kv_layer, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        # Offload reports its store's changes to the scheduler's index; P/D reports nothing.
        return self.worker.build_connector_worker_meta()

    # ---- vLLM's metrics (stats.py) --------------------------------------------------------

    def get_kv_connector_stats(self) -> KVMoveConnectorStats | None:
        """This worker's hand-offs (or store loads and saves) since vLLM last asked."""
        if self._worker is None:
            return None   # the scheduler's side moves no bytes
        data = self._worker.take_stats()
        return None if data is None else KVMoveConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVMoveConnectorStats | None:
        return KVMoveConnectorStats(data=data) if data is not None else KVMoveConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVMovePromMetrics:
        return KVMovePromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- vLLM 0.33's sleep mode (sleep.py; 0.32 never calls these) ------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Offload yes, P/D no: 0.33's default says yes, which P/D's registrations cannot keep.
        from kvmove.integrations.vllm.sleep import supports_sleep_mode
        return supports_sleep_mode(kv_transfer_config)

    def unregister_kv_caches(self) -> None:
        from kvmove.integrations.vllm.sleep import check_sleep
        check_sleep(self.config.offload, "unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        from kvmove.integrations.vllm.sleep import check_sleep
        check_sleep(self.config.offload, "restore_kv_caches")


def _register_by_name() -> None:
    """Registers this class in vLLM's connector factory under its name, once. vLLM's
    MultiConnector rebuilds each child's stats in the API server by the child's registered
    name (``get_connector_class_by_name``), and a connector loaded by module path is not
    registered: without this, kvmove's stats inside a MultiConnector crashed vLLM's stats
    logging ("Connector 'KVMoveConnector' is not registered"). The API server imports this
    module when MultiConnector builds its children's Prometheus metrics."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("KVMoveConnector", __name__, "KVMoveConnector")
    except ValueError:   # registered already (this module imported again, or by the user)
        pass


_register_by_name()


# Both sides are imported only for the role that uses them: offload's need no agent, P/D's no
# store, and a scheduler process never imports a worker's. Each is built from
# (vllm_config, config, kv_cache_config).
def _scheduler_class(config: ConnectorConfig) -> Callable[..., ConnectorScheduler]:
    if config.offload:
        from kvmove.integrations.vllm.offload import OffloadScheduler
        return OffloadScheduler
    from kvmove.integrations.vllm.pd_scheduler import PDScheduler
    return PDScheduler


def _worker_class(config: ConnectorConfig) -> Callable[..., ConnectorWorker]:
    if config.offload:
        from kvmove.integrations.vllm.offload import OffloadWorker
        return OffloadWorker
    from kvmove.integrations.vllm.pd_worker import PDWorker
    return PDWorker
