"""The core's log (``csrc/common/log.h``) in Python's ``logging``.

C++ records wait in a bounded queue; a daemon thread takes them and emits them on
``logging.getLogger("kvmove.<name>")`` ("kvmove.stream", "kvmove.agent", "kvmove.ucx"...).
The core's threshold follows the ``kvmove`` logger's effective level, so one setting governs
C++ and Python alike: ``KVMOVE_LOG_LEVEL`` (debug, info, warning, error), or the
application's own logging configuration.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvmove import _C
from kvmove.errors import ConfigError

__all__ = ["LEVELS", "set_level", "start"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_POLL_SECONDS = 0.2
_started = threading.Event()


def set_level(level: str | int) -> None:
    """Sets the ``kvmove`` logger's level (and so the core's): a name of ``LEVELS`` or a
    logging level."""
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ConfigError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
        level = LEVELS[level.lower()]
    logging.getLogger("kvmove").setLevel(level)
    _C.set_log_level(_effective())


def _effective() -> int:
    return logging.getLogger("kvmove").getEffectiveLevel()


def _pump() -> None:
    # It sleeps here, in Python, not inside the core: Python ends daemon threads at shutdown,
    # which must not happen in C++ frames.
    while True:
        _C.set_log_level(_effective())
        for level, name, message in _C.take_log(1000):
            logging.getLogger(f"kvmove.{name}").log(level, message)
        time.sleep(_POLL_SECONDS)


def start() -> None:
    """Applies ``KVMOVE_LOG_LEVEL`` and starts the thread that drains the core's log (once)."""
    if _started.is_set():
        return
    _started.set()
    if os.environ.get("KVMOVE_LOG_LEVEL"):
        set_level(os.environ["KVMOVE_LOG_LEVEL"])
    _C.set_log_level(_effective())
    threading.Thread(target=_pump, name="kvmove-log", daemon=True).start()
