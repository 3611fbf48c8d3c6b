"""The two sides of kvmove's vLLM connector, as ``KVMoveConnector`` sees them: what a
scheduler side (``PDScheduler``, ``OffloadScheduler``) and a worker side (``PDWorker``,
``OffloadWorker``) each provide. The connector hands every call of vLLM's
``KVConnectorBase_V1`` to one of them; these Protocols make that a checked contract rather
than ``Any`` and ``getattr`` probing.

The argument types are vLLM's (``Request``, ``SchedulerOutput``...); they are ``Any`` here so
this module imports without vLLM.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ConnectorScheduler", "ConnectorWorker"]


class ConnectorScheduler(Protocol):
    """Runs in vLLM's engine core: decides what each step's workers move."""

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> Any: ...

    def update_connector_output(self, connector_output: Any) -> None: ...

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]: ...

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]: ...

    def has_pending_work(self) -> bool: ...

    def take_events(self) -> list[Any]: ...

    def shutdown(self) -> None: ...


class ConnectorWorker(Protocol):
    """Runs beside the model, in each worker process: moves the bytes. ``meta`` is the step's
    metadata from the scheduler side."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None: ...

    def start_load_kv(self, meta: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, meta: Any) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def build_connector_worker_meta(self) -> Any: ...

    def take_stats(self) -> dict[str, Any] | None: ...

    def shutdown(self) -> None: ...
