"""Argument checks shared by the Python configs: each raises ConfigError naming the value."""

from __future__ import annotations

import math
from typing import Any

from kvmove.errors import ConfigError

__all__ = ["require_positive_finite", "require_positive_int"]


def require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")


def require_positive_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be positive and finite, got {value!r}")
