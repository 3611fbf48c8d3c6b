"""What ``kvmove-serve --vllm-prefill ... --vllm-decode ...`` is configured with
(``ProxyConfig``), checked before anything starts. Standard library only, so that the
command line (``--help`` included) works in a core install, without the proxy's extras."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.errors import ConfigError
from kvmove.integrations.vllm.params import TransferMode
from kvmove.serve.config import LOOPBACK_HOSTS, ROUTINGS, ConnectionLimits

__all__ = ["KV_MODES", "ProxyConfig"]

KV_MODES = tuple(mode.value for mode in TransferMode)


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """What the proxy needs; ``__post_init__`` refuses what cannot work."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    kv_mode: TransferMode = TransferMode.PUSH
    routing: str = "kv"   # the prefill instance: kv (its KV events) or least-loaded
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout: float = 120.0  # seconds: any upstream call, and a stream's gap
    max_pending: int = 256
    max_body_bytes: int = 4 * 2**20
    connections: ConnectionLimits = ConnectionLimits()
    allowed_hosts: tuple[str, ...] | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        for flag, urls in (("--vllm-prefill", self.prefill), ("--vllm-decode", self.decode)):
            if not urls:
                raise ConfigError(f"{flag} needs at least one URL")
            for url in urls:
                if not url.startswith(("http://", "https://")) or url.endswith("/"):
                    raise ConfigError(f"{flag} {url!r} is not an http(s) URL without a "
                                      "trailing slash, like http://10.0.0.1:8100")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"{flag} names an instance twice: {' '.join(urls)}")
        if self.kv_mode not in KV_MODES:
            raise ConfigError(f"--kv-mode must be one of {', '.join(KV_MODES)}, got "
                              f"{self.kv_mode!r}")
        object.__setattr__(self, "kv_mode", TransferMode(self.kv_mode))
        if self.routing not in ROUTINGS:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTINGS)}, got "
                              f"{self.routing!r}")
        if not self.request_timeout > 0:
            raise ConfigError(f"--request-timeout must be positive, got {self.request_timeout}")
        for name in ("max_pending", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")

    def hosts(self) -> frozenset[str] | None:
        """The Host names served, as ``ServeConfig.hosts`` (DNS rebinding); None: any."""
        names = self.allowed_hosts or (*LOOPBACK_HOSTS, self.host)
        if "*" in names:
            return None
        return frozenset(n.lower().strip("[]") for n in names)
