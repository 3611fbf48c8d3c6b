"""The core's log (``csrc/common/log.h``) in Python's ``logging``.

C++ records wait in a bounded queue; a daemon thread takes them and emits them on
``logging.getLogger("kvmove.<name>")`` ("kvmove.stream", "kvmove.agent", "kvmove.ucx"...),
and an exit handler stops it and emits what is left.

The thread waits in Python (``Event.wait``) and takes records without blocking, instead of
blocking in the core's ``take_log``: a daemon thread still inside a GIL-releasing C++ call
when the interpreter finalizes is killed as it takes the GIL back, in a C++ destructor, and
``std::terminate`` aborts the process ("terminate called without an active exception",
exit status 134). Measured with the blocking wait: 2 of 4 ``kvmove-bench plan`` runs and 3
of 4 runs of ``import kvmove; time.sleep(0.2)`` ended that way; with this one, none of 200
of the latter. Records reach ``logging`` at most ``_POLL_SECONDS`` after they are made.

The core's threshold follows the ``kvmove`` logger's effective level, so one setting governs
C++ and Python alike: ``KVMOVE_LOG_LEVEL`` (debug, info, warning, error), or the
application's own logging configuration.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from kvmove import _C
from kvmove.errors import ConfigError

__all__ = ["LEVELS", "configure_cli", "set_level", "start"]

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_POLL_SECONDS = 0.1
_started = threading.Event()
_stopping = threading.Event()


def set_level(level: str | int) -> None:
    """Sets the ``kvmove`` logger's level (and so the core's): a name of ``LEVELS`` or a
    logging level."""
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ConfigError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
        level = LEVELS[level.lower()]
    logging.getLogger("kvmove").setLevel(level)
    _C.set_log_level(_effective())


def configure_cli(level: str | None) -> None:
    """For a command-line tool: kvmove's records go to stderr (time, level, logger, message),
    at ``level`` if given (``--log-level``), else as ``KVMOVE_LOG_LEVEL`` set it, else at
    warning. Other libraries' loggers keep the root's warning level: the option is kvmove's.

    ``level`` is also exported as ``KVMOVE_LOG_LEVEL``, so that the processes the tool starts
    (a benchmark's peer, a server's workers) log at the same level.
    """
    logging.basicConfig(stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level is not None:
        set_level(level)
        os.environ["KVMOVE_LOG_LEVEL"] = level


def _effective() -> int:
    return logging.getLogger("kvmove").getEffectiveLevel()


def _drain() -> None:
    """Emits the records queued now (never waits in the core) and updates its threshold."""
    _C.set_log_level(_effective())
    for level, name, message in _C.take_log(1000):
        logging.getLogger(f"kvmove.{name}").log(level, message)


def _pump() -> None:
    while not _stopping.wait(_POLL_SECONDS):
        _drain()


def _stop(thread: threading.Thread) -> None:
    """At exit, before the interpreter finalizes: stop the pump, then emit what is left."""
    _stopping.set()
    thread.join()
    _drain()


def start() -> None:
    """Applies ``KVMOVE_LOG_LEVEL`` and starts the thread that drains the core's log (once)."""
    if _started.is_set():
        return
    _started.set()
    if os.environ.get("KVMOVE_LOG_LEVEL"):
        set_level(os.environ["KVMOVE_LOG_LEVEL"])
    _C.set_log_level(_effective())
    thread = threading.Thread(target=_pump, name="kvmove-log", daemon=True)
    thread.start()
    atexit.register(_stop, thread)
