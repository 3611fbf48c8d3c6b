"""Addresses on the command line of ``kvmove-bench transfer --listen/--connect``."""

from __future__ import annotations

import socket

from kvmove.errors import ConfigError

__all__ = ["parse_address", "route_address"]


def parse_address(text: str, what: str, default_host: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` (or ``PORT`` alone with a ``default_host``) as (host, port).

    Raises:
        ConfigError: naming ``what`` and the value.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or (default_host or "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        form = "[HOST:]PORT" if default_host else "HOST:PORT"
        raise ConfigError(f"{what} must be {form} with a port in 1-65535, got {text!r}")
    return host, int(port)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (where a peer there reaches us)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))  # UDP: picks the route, sends nothing
        except OSError as error:
            raise ConfigError(f"no route to {host}: {error.strerror or error}") from None
        return str(probe.getsockname()[0])
