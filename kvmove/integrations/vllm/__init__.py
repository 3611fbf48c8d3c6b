"""kvmove as a vLLM KV connector (vLLM's ``KVConnectorBase_V1``), loaded by module path::

    --kv-transfer-config '{"kv_connector": "KVMoveConnector",
                           "kv_connector_module_path": "kvmove.integrations.vllm",
                           "kv_role": "kv_producer", "kv_port": 5600}'

``kv_role`` picks what it does (docs/vllm.md):

- ``kv_producer`` / ``kv_consumer`` / ``kv_both`` (either, per request, as NixlConnector's):
  prefill/decode disaggregation over kvmove agents,
  speaking vLLM's P/D protocol (``kv_transfer_params``, ``params.py``), so proxies written
  for vLLM's own NixlConnector work unchanged: ``PDScheduler`` (``pd_scheduler.py``) and
  ``PDWorker`` (``pd_worker.py``, with its prefill and decode parts in ``pd_prefill.py`` and
  ``pd_decode.py``).
- ``kv_both`` with ``"offload": true``: offload to a ``kvmove.KVStore`` (host and disk
  tiers) keyed by vLLM's block hashes; a repeated prefix loads instead of being prefilled
  again: ``OffloadScheduler`` and ``OffloadWorker`` (``offload.py``).

The package imports lazily: ``KVMoveConnector`` (``connector.py``) needs vLLM, and is
imported when vLLM asks for it (``getattr(module, "KVMoveConnector")``); ``params.py`` does
not, so ``kvmove-serve``'s proxy uses it without vLLM installed. Loading it checks the
installed vLLM against ``versions.SUPPORTED_VLLM`` (a clear ``ConfigError`` outside it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmove.integrations.vllm.connector import KVMoveConnector

__all__ = ["KVMoveConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVMoveConnector":
        # Where vLLM loads the connector (kv_connector_module_path): a vLLM outside the
        # tested range is refused here, before its base class is subclassed (versions.py).
        from kvmove.integrations.vllm.versions import check_vllm_version
        check_vllm_version()
        from kvmove.integrations.vllm.connector import KVMoveConnector
        return KVMoveConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
