"""The core's log (``csrc/common/log.h``) in Python's ``logging``.

C++ records wait in a bounded queue; a daemon thread takes them and emits them on
``logging.getLogger("kvmove.<name>")`` ("kvmove.stream", "kvmove.agent", "kvmove.ucx"...).
The core's threshold follows the ``kvmove`` logger's effective level, so one setting governs
C++ and Python alike: ``KVMOVE_LOG_LEVEL`` (debug, info, warning, error), or the
application's own logging configuration.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from kvmove import _C
from kvmove.errors import ConfigError

__all__ = ["LEVELS", "set_level", "start"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_POLL_SECONDS = 0.5
_started = threading.Event()
_stopping = threading.Event()
_pump_thread: threading.Thread | None = None


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
    while not _stopping.is_set():
        _C.set_log_level(_effective())
        for level, name, message in _C.take_log(_POLL_SECONDS, 1000):
            logging.getLogger(f"kvmove.{name}").log(level, message)


def _stop_pump() -> None:
    """Ends the pump before the interpreter finalizes (an ``atexit`` hook).

    A daemon thread that comes back from ``take_log`` (which waits with the GIL released)
    while the interpreter finalizes is ended by ``pthread_exit`` inside a pybind11 frame,
    and the forced unwind through it calls ``std::terminate``: the process died of SIGABRT
    at exit (exit code 134, every time torch was imported too: its finalization is long
    enough for the 0.5 s poll to come back). Stopping it first costs at most one poll.
    """
    _stopping.set()
    if _pump_thread is not None:
        _pump_thread.join(_POLL_SECONDS * 4)


def start() -> None:
    """Applies ``KVMOVE_LOG_LEVEL`` and starts the thread that drains the core's log (once)."""
    if _started.is_set():
        return
    _started.set()
    if os.environ.get("KVMOVE_LOG_LEVEL"):
        set_level(os.environ["KVMOVE_LOG_LEVEL"])
    _C.set_log_level(_effective())
    global _pump_thread
    _pump_thread = threading.Thread(target=_pump, name="kvmove-log", daemon=True)
    _pump_thread.start()
    atexit.register(_stop_pump)
