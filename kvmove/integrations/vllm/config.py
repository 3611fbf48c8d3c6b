"""The connector's settings: vLLM's ``kv_transfer_config`` plus kvmove's keys in its
``kv_connector_extra_config`` (every key checked; an unknown one is an error naming it)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import kvmove
from kvmove.errors import ConfigError

# Under "vllm.": vLLM's handlers print it beside its own lines.
logger = logging.getLogger("vllm.kvmove.config")


class KVRole(enum.StrEnum):
    """vLLM's ``kv_role``, the job the connector does (the values are vLLM's strings)."""

    PRODUCER = "kv_producer"   # a prefill instance: hands its requests' KV to decodes
    CONSUMER = "kv_consumer"   # a decode instance: receives a prompt's KV from a prefill
    BOTH = "kv_both"           # either, per request (its kv_transfer_params), as NixlConnector


class LoadPolicy(enum.StrEnum):
    """Offload's ``load_policy``: which stored blocks a request loads instead of computing
    (``KVStore``'s ``load_policy`` values, and ``never``)."""

    AUTO = "auto"              # those whose load beats recomputing them (measured)
    ALWAYS = "always"          # whatever is stored
    NEVER = "never"            # none: store, never load


# The key's old name and values (the store said load_policy, the connector load_rule): still
# taken, with a warning.
OLD_LOAD_RULE = {"measured": LoadPolicy.AUTO, "always": LoadPolicy.ALWAYS,
                 "never": LoadPolicy.NEVER}


PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PositiveGiB = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ExtraConfig(BaseModel):
    """kvmove's keys in ``kv_connector_extra_config``, checked as vLLM checks its own config
    (a pydantic model): types strict (``"30"`` is not a number, ``true`` not a count), every
    number finite, an unknown key refused. docs/vllm.md explains each."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    host: str = "127.0.0.1"                 # where this instance's agents serve (or kv_ip)
    net_devices: str | None = None          # UCX devices (None: $UCX_NET_DEVICES, else host's)
    lease_seconds: PositiveSeconds = 60.0   # P holds finished blocks this long for D at most
    load_timeout: PositiveSeconds = 30.0    # D gives a hand-off up after this long
    # per-block XXH3 on every hand-off, verified by the receiver (None: on where the KV is in
    # host memory, as kvmove.Agent)
    checksums: bool | None = None
    transports: str | None = None           # UCX transports (None: UCX's choice)
    # a decode's staging blocks per prefill rank of another tensor parallelism (None: room
    # for two requests of max_model_len, at most a quarter of its cache's blocks)
    staging_blocks: Annotated[int, Field(gt=0)] | None = None
    key_file: str | None = None             # the deployment key (docs/security.md)
    # offload (kv_both with "offload": true): keeps KV blocks in a kvmove.KVStore
    offload: bool = False
    store_host_gb: PositiveGiB = 1.0
    store_disk_dir: str | None = None
    store_disk_gb: PositiveGiB = 16.0
    load_policy: Annotated[LoadPolicy, Field(strict=False)] = LoadPolicy.AUTO


@dataclass(frozen=True)
class ConnectorConfig:
    role: KVRole
    engine_id: str
    port: int
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0   # vLLM's data-parallel rank: each is an engine of its own
    settings: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(name)

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        kv = vllm_config.kv_transfer_config
        roles = [r.value for r in KVRole]
        if kv.kv_role not in roles:
            raise ConfigError(f"kv_role must be one of {roles}, got {kv.kv_role!r}")
        parallel = vllm_config.parallel_config
        extra = dict(kv.kv_connector_extra_config or {})
        if "host" not in extra and getattr(kv, "kv_ip", None):
            extra["host"] = kv.kv_ip  # vLLM's own field where it has one (0.32 has not)
        config = cls(role=KVRole(kv.kv_role), engine_id=str(kv.engine_id), port=int(kv.kv_port),
                   tp_rank=int(getattr(parallel, "rank", 0) or 0) % max(
                       1, int(parallel.tensor_parallel_size)),
                   tp_size=int(parallel.tensor_parallel_size),
                   dp_rank=_dp_rank(parallel), settings=parse_extra(extra))
        if config.offload and config.role is not KVRole.BOTH:
            raise ConfigError(f"kv_connector_extra_config['offload'] needs kv_role 'kv_both' "
                              f"(an instance that both stores and loads), got {kv.kv_role!r}")
        if config.serves_prefill:
            config.check_listen_address()
        return config

    @property
    def serves_prefill(self) -> bool:
        """Its agents listen for decodes: a P/D producer, or kv_both (either role, per
        request: NixlConnector's meaning) unless it offloads."""
        return self.role is KVRole.PRODUCER or (self.role is KVRole.BOTH and not self.offload)

    @property
    def engine_port(self) -> int:
        """Where this engine's tensor-parallel rank 0 listens, as NixlConnector places its side
        channel: ``kv_port + dp_rank * tp_size``, so data-parallel engines on one host never
        collide; rank ``r`` listens on ``engine_port + r``, and decodes are told
        ``engine_port``."""
        return self.port + self.dp_rank * self.tp_size

    @property
    def listen_port(self) -> int:
        return self.engine_port + self.tp_rank

    def check_listen_address(self) -> None:
        """A prefill's agent listens on ``host:listen_port`` and tells decodes so in every
        answer: refused here, at start, rather than in the first answer."""
        if not self.settings["host"]:
            raise ConfigError("kv_connector_extra_config['host'] must be an address, got ''")
        last = self.engine_port + self.tp_size - 1
        if not (0 < self.port and last < 65536):
            ranks = f"{self.tp_size} tensor-parallel ranks"
            if self.dp_rank:
                ranks += f" of data-parallel rank {self.dp_rank} (from {self.engine_port})"
            raise ConfigError(f"kv_port must leave a port in [1, 65535] for each of the "
                              f"{ranks}, got {self.port}")


def _dp_rank(parallel: Any) -> int:
    """The engine's data-parallel rank (``data_parallel_index`` in newer vLLM)."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, name, None)
        if value is not None:
            return int(value)
    return 0


def parse_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` checked (``ExtraConfig``), defaults filled in; the
    first problem a ``ConfigError`` naming the key, what it must be and the value."""
    extra = _renamed_load_rule(extra)
    unknown = sorted(set(extra) - set(ExtraConfig.model_fields))
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; kvmove's "
                          f"connector takes {sorted(ExtraConfig.model_fields)}")
    try:
        return dict(ExtraConfig(**extra))
    except ValidationError as error:
        first = error.errors()[0]
        key = first["loc"][0] if first["loc"] else "?"
        raise ConfigError(f"kv_connector_extra_config[{key!r}]: {_lower(first['msg'])}, got "
                          f"{first['input']!r}") from None


def _lower(message: str) -> str:
    return message[:1].lower() + message[1:]


def _renamed_load_rule(extra: dict[str, Any]) -> dict[str, Any]:
    """``load_rule`` (the old name) as ``load_policy``, with a warning; both: an error."""
    if "load_rule" not in extra:
        return extra
    extra = dict(extra)
    rule = extra.pop("load_rule")
    if "load_policy" in extra:
        raise ConfigError("kv_connector_extra_config has both 'load_policy' and 'load_rule' "
                          "(its old name): keep 'load_policy'")
    if rule not in OLD_LOAD_RULE:
        raise ConfigError(f"kv_connector_extra_config['load_rule'] (now 'load_policy') must be "
                          f"one of {sorted(OLD_LOAD_RULE)}, got {rule!r}")
    extra["load_policy"] = OLD_LOAD_RULE[rule].value
    logger.warning("kvmove: kv_connector_extra_config['load_rule'] is now 'load_policy' "
                   "(auto, always, never: the KVStore's words); read %r as load_policy %r",
                   rule, extra["load_policy"])
    return extra


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "float8_e4m3fn": "float8"}


def layout_of(vllm_config: Any) -> kvmove.KVSpec:
    """The KV layout of one worker (its tensor-parallel share of the KV heads)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    torch_dtype = str(model.dtype).removeprefix("torch.")
    dtype = _TORCH_DTYPES.get(torch_dtype if cache_dtype == "auto" else cache_dtype)
    if dtype is None:
        raise ConfigError(f"kvmove's connector moves KV of dtype {sorted(_TORCH_DTYPES)}, got "
                          f"cache dtype {cache_dtype!r} (model dtype {torch_dtype})")
    return kvmove.KVSpec(num_layers=model.get_num_layers(parallel),
                           num_kv_heads=model.get_num_kv_heads(parallel),
                           head_dim=model.get_head_size(), dtype=dtype,
                           block_size=vllm_config.cache_config.block_size)


def total_kv_heads_of(vllm_config: Any) -> int:
    """The model's KV heads, all ranks' together."""
    return int(vllm_config.model_config.get_total_num_kv_heads())


def wrap_kv_caches(kv_caches: dict[str, Any], layout: kvmove.KVSpec,
                   on_cpu: bool | None = None) -> kvmove.KVCache:
    """vLLM's own KV tensors (``register_kv_caches``), wrapped zero-copy, whatever its
    attention backend: the CPU backend's ``[num_blocks, num_kv_heads, block_size,
    2 * head_dim]`` per layer (``on_cpu``: vLLM's platform is the CPU, asked when None), or on
    a GPU flash-attention's ``[2, num_blocks, ...]`` or FlashInfer's (and others')
    ``[num_blocks, 2, ...]``, each block NHD or HND in memory.

    On a GPU vLLM hands each layer in its backend's logical shape, a view of an allocation in
    the backend's stride order (FlashInfer's HND: ``[num_blocks, 2, num_kv_heads, block_size,
    head_dim]`` in memory, viewed as ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``):
    ``KVCache.wrap`` recognises the view by its strides and wraps it in its memory order. The
    cache's ``order`` then says which it was, and a store or a peer of another order refuses
    it rather than mix them up."""
    if len(kv_caches) != layout.num_layers:
        raise ConfigError(f"vLLM registered {len(kv_caches)} KV tensors, the model config "
                          f"has {layout.num_layers} layers")
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    if on_cpu:
        return kvmove.KVCache.wrap(kv_caches, layout=layout, block_dim=0, order="vllm-cpu",
                                   pool=None)
    shape = tuple(next(iter(kv_caches.values())).shape)
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    why = ""
    for planes_first, (block_dim, kv_dim) in ((True, (1, 0)), (False, (0, 1))):
        if len(shape) != 5 or shape[kv_dim] != 2 or (shape[0] == 2) != planes_first:
            continue
        # vLLM's logical shapes are NHD ([..., block_size, heads, head_dim]); HND accepted too
        logical = {(bs, heads, dim): "NHD", (heads, bs, dim): "HND"}.get(shape[2:])
        if logical is None:
            continue
        try:  # wrap recognises a view of the other order by its strides
            return kvmove.KVCache.wrap(kv_caches, layout=layout, block_dim=block_dim,
                                       kv_dim=kv_dim, order=logical, pool=None)
        except ConfigError as error:
            why = f": {error}"
            break
    raise ConfigError(f"vLLM's KV tensors are {shape} (strides "
                      f"{tuple(next(iter(kv_caches.values())).stride())}), none of the "
                      f"layouts kvmove wraps for {layout}: [2, num_blocks, ...] (flash-"
                      f"attention) or [num_blocks, 2, ...] (FlashInfer and others), each block "
                      f"[block_size, heads, head_dim] (NHD) or [heads, block_size, head_dim] "
                      f"(HND) in memory{why}")
