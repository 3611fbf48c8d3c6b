"""vLLM's sleep mode (0.33: ``supports_sleep_mode``, ``unregister_kv_caches``,
``restore_kv_caches``) as kvmove's two jobs can follow it.

Sleep releases the KV cache's physical memory and wake-up maps new memory at the same virtual
addresses (vLLM's ``CuMemAllocator``), with every transfer drained first. So what survives
depends on what the worker side holds on those addresses:

- offload (``OffloadWorker``): descriptors only (``KVCache.wrap``: addresses, no
  registration); the store copies to and from them, and its tiers are its own memory. The
  addresses are valid again after wake-up, so sleep needs nothing from it: it supports sleep.
- P/D (``PDWorker``): one ``kvmove.Agent`` registered the KV tensors with UCX when it was built
  and its peers hold those registrations' remote keys. After a remap they name freed pages
  (NixlConnector's push producers refuse sleep for the same reason). The agent has no
  re-registration, so P/D refuses sleep: vLLM then rejects ``--enable-sleep-mode`` at start-up
  (``VllmConfig``), rather than moving KV into stale pages.

vLLM 0.32 has none of these hooks and never calls them.
"""

from __future__ import annotations

from typing import Any

from kvmove.errors import ConfigError

__all__ = ["supports_sleep_mode", "check_sleep"]


def _offloads(kv_transfer_config: Any) -> bool:
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return bool(extra.get("offload", False))


def supports_sleep_mode(kv_transfer_config: Any) -> bool:
    """Offload follows sleep mode, P/D does not (see the module's docstring).

    Args:
        kv_transfer_config: vLLM's ``KVTransferConfig`` (its ``kv_connector_extra_config``
            says which job: ``"offload": true`` or P/D).
    """
    return _offloads(kv_transfer_config)


def check_sleep(offload: bool, hook: str) -> None:
    """What ``unregister_kv_caches`` and ``restore_kv_caches`` do: nothing for offload (its
    descriptors are valid again at wake-up; both hooks are idempotent), an error for P/D,
    which vLLM calls only when its start-up check (``supports_sleep_mode``) was bypassed.

    Raises:
        ConfigError: ``offload`` is false (P/D's agent cannot re-register the KV cache).
    """
    if offload:
        return
    raise ConfigError(f"vLLM called {hook} on kvmove's P/D connector, which does not support "
                      f"sleep mode (its agent's UCX registrations of the KV cache cannot be "
                      f"remade after a remap); run P/D without --enable-sleep-mode")
