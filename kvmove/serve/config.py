"""What ``kvmove-serve`` runs: the mode, the workers, the engine, and the HTTP limits."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from kvmove._log import LEVELS
from kvmove.auth import key_from_file, resolve_key
from kvmove.bootstrap import is_loopback
from kvmove.engine.role import Role
from kvmove.errors import ConfigError
from kvmove.serve.planner import Bounds

__all__ = ["LOOPBACK_HOSTS", "MODES", "ROUTINGS", "ConnectionLimits", "Mode", "ServeConfig"]


class Mode(enum.StrEnum):
    """How the engines share the work: ``colocated`` (prefill and decode in one batch),
    ``chunked`` (the same, prompts in chunks), ``disagg`` (prefill and decode workers, the KV
    handed over by kvmove). A ``StrEnum``, as ``Role``: its members are the CLI's strings."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGG = "disagg"


MODES: tuple[str, ...] = tuple(mode.value for mode in Mode)  # as Role's ROLES
ROUTINGS = ("kv", "least-loaded")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long a request may take to arrive, and how many connections the HTTP server holds
    (``connections.py``; the body's deadline is ``admission.py``'s).

    Attributes:
        header_timeout: seconds for a request's headers (``--header-timeout``).
        body_timeout: seconds for a completion's body, from its headers (``--body-timeout``).
        max_connections: connections held at once (``--max-connections``); None: from the
            file-descriptor limit (``connections.max_connections_for``: 896 of 1,024).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not 0 < value < 1e6:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        value = self.max_connections
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or
                                  value < 1):
            raise ConfigError(f"max_connections must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """``kvmove-serve``'s options (``kvmove-serve --help`` says what each one does)."""

    mode: Mode = Mode.DISAGG  # a string of MODES is taken and turned into its Mode
    # kv: where the prompt's prefix is cached, traded off against the queue (kv_index.py);
    # the default, as it costs nothing without shared prefixes (it then spreads prefill work)
    routing: str = "kv"
    workers: int = 2        # colocated / chunked: engine instances
    prefill: int = 1        # disagg
    decode: int = 1         # disagg
    model: str = "tiny"
    chunk_size: int = 512   # chunked (and the prefill workers of disagg)
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    host: str = "127.0.0.1"          # the HTTP server
    port: int = 8000
    agent_host: str = "127.0.0.1"    # where workers' kvmove agents listen
    net_devices: str | None = None   # UCX devices of their agents (None: Agent's default)
    key_file: str | None = None      # the deployment key (docs/security.md); None: host key
    transports: str | None = None
    request_timeout: float = 120.0
    transfer_timeout: float = 60.0  # a KV hand-off's lease (disagg), before it is given up
    start_timeout: float = 120.0
    pin_cpus: bool = True   # each worker on its own cores when there are enough
    store_dir: str | None = None  # a KVStore disk tier per prefill/colocated worker, in here
    store_host_gb: float = 0.0    # and a host tier of this size (0: none)
    store_disk_gb: float = 16.0   # the disk tier's size per worker
    checksums: bool = True        # per-block checksums on every KV hand-off (disagg)
    restart: bool = True          # a dead worker is started again and re-admitted
    log_level: str = "info"       # the router's, uvicorn's and every worker's
    max_pending: int = 256        # completions admitted at once (more: 429)
    max_body_bytes: int = 4 * 2**20  # a request body (more: 413)
    connections: ConnectionLimits = ConnectionLimits()  # deadlines, and how many are held
    allowed_hosts: tuple[str, ...] | None = None  # Host headers served (None: loopback + host)
    # Workers as Ray actors (ray_workers.py): None, the local launcher (child processes);
    # "local", a Ray started here; else the address of a Ray cluster to connect to.
    ray: str | None = None
    # Ray resources per role ({"prefill": {"CPU": 1, "GPU": 1}}); a role not given gets
    # ray_workers.default_resources'.
    ray_resources: dict[str, dict[str, float]] | None = None
    planner: bool = False         # disagg: add and drain workers per pool (planner.py)
    prefill_bounds: tuple[int, int] | None = None  # the planner's (min, max); None: 1, 2 x
    decode_bounds: tuple[int, int] | None = None   # the pool's starting size
    planner_interval: float = 1.0  # seconds between the planner's samples

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        for name in ("workers", "prefill", "decode", "chunk_size", "num_blocks", "block_size",
                     "max_num_seqs", "max_num_batched_tokens", "max_pending",
                     "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("request_timeout", "transfer_timeout", "start_timeout"):
            if not 0 < getattr(self, name) < 1e6:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.store_host_gb < 1e6:
            raise ConfigError(f"store_host_gb must be >= 0, got {self.store_host_gb!r}")
        if not 0 < self.store_disk_gb < 1e6:
            raise ConfigError(f"store_disk_gb must be positive, got {self.store_disk_gb!r}")
        if self.log_level not in LEVELS:
            raise ConfigError(f"log_level must be one of {sorted(LEVELS)}, "
                              f"got {self.log_level!r}")
        if self.key_file is not None:
            key_from_file(self.key_file, "--key-file")  # readable, long enough, or an error
        if not is_loopback(self.agent_host) and self.key_file is None and \
                resolve_key().host_only:
            raise ConfigError(f"agent_host {self.agent_host!r} is not loopback: give the "
                              "workers a deployment key (--key-file, or KVMOVE_KEY_FILE / "
                              "KVMOVE_KEY), the host key proves nothing to another host")
        if self.planner and self.mode != Mode.DISAGG:
            raise ConfigError(f"the planner sizes the prefill and decode pools: it needs "
                              f"mode 'disagg', got {self.mode.value!r}")
        if not 0 < self.planner_interval < 1e6:
            raise ConfigError(f"planner_interval must be positive, got "
                              f"{self.planner_interval!r}")
        self.bounds()  # valid, or ConfigError now
        if self.allowed_hosts is not None and not all(self.allowed_hosts):
            raise ConfigError(f"allowed_hosts must be host names, got {self.allowed_hosts!r}")
        self._check_ray()

    def _check_ray(self) -> None:
        if self.ray is not None and not self.ray:
            raise ConfigError("ray must be 'local' or a Ray cluster's address, got ''")
        if self.ray_resources is None:
            return
        if self.ray is None:
            raise ConfigError("ray_resources needs ray (--ray-resources without --ray)")
        for role, amounts in self.ray_resources.items():
            if role not in self.pools():
                raise ConfigError(f"ray_resources are for the roles "
                                  f"{tuple(map(str, self.pools()))} of mode "
                                  f"{self.mode}, got {role!r}")
            for name, amount in amounts.items():
                if not isinstance(name, str) or isinstance(amount, bool) or \
                        not isinstance(amount, int | float) or not 0 <= amount < 1e6:
                    raise ConfigError(f"ray_resources[{role!r}] must map resource names to "
                                      f"amounts >= 0, got {name!r}: {amount!r}")

    def hosts(self) -> frozenset[str] | None:
        """The Host header names served (lower case, no port); None: any (``*``). By default
        the loopback names and the address the server is bound to: a page elsewhere that
        points its own name at 127.0.0.1 (DNS rebinding) sends its own name, and is refused."""
        names = self.allowed_hosts or (*LOOPBACK_HOSTS, self.host)
        if "*" in names:
            return None
        return frozenset(n.lower().strip("[]") for n in names)

    def store_args(self, name: str, role: Role) -> list[str]:
        """A worker's KVStore options: prefill and colocated workers only (decode workers
        never prefill), each with its own directory (a disk tier is one process's)."""
        if role == Role.DECODE or (self.store_dir is None and not self.store_host_gb):
            return []
        args = ["--store-host-gb", str(self.store_host_gb)]
        if self.store_dir is not None:
            args += ["--store-dir", os.path.join(self.store_dir, name),
                     "--store-disk-gb", str(self.store_disk_gb)]
        return args

    def roles(self) -> list[tuple[str, Role]]:
        """(worker name, role) for every worker process."""
        if self.mode == Mode.DISAGG:
            return ([(f"prefill-{i}", Role.PREFILL) for i in range(self.prefill)] +
                    [(f"decode-{i}", Role.DECODE) for i in range(self.decode)])
        return [(f"worker-{i}", Role.COLOCATED) for i in range(self.workers)]

    def bounds(self) -> dict[Role, Bounds]:
        """The planner's bounds per pool (empty without the planner)."""
        if not self.planner:
            return {}
        given = {Role.PREFILL: (self.prefill_bounds, self.prefill),
                 Role.DECODE: (self.decode_bounds, self.decode)}
        return {pool: Bounds(*bound) if bound is not None else Bounds(1, 2 * start)
                for pool, (bound, start) in given.items()}

    def pools(self) -> tuple[Role, ...]:
        """The roles of this mode's workers (a pool per role)."""
        return (Role.PREFILL, Role.DECODE) if self.mode == Mode.DISAGG else (Role.COLOCATED,)
