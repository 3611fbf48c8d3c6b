"""``kvmove-serve`` as a process for the serving benchmark (``serve``): one fresh server per
mode, in its own session on a free port, stopped with SIGTERM (SIGKILL to its whole session
after the deadline; anything of it still alive after it exits is killed too).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from kvmove.bench.report import BenchError

if TYPE_CHECKING:
    from kvmove.bench.serve_config import ServeBenchConfig

__all__ = ["READY", "ServerProcess", "serve_arguments"]

logger = logging.getLogger(__name__)

READY = "kvmove-serve ready on "


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_arguments(config: ServeBenchConfig, mode: str, routing: str = "kv",
                    planner: bool = False) -> list[str]:
    """kvmove-serve's options for the serving benchmark's run of ``mode``."""
    arguments = ["--mode", mode, "--routing", routing, "--model", config.model,
                 "--chunk-size", str(config.chunk_size)]
    for option, count in config.instances(mode).items():
        arguments += [f"--{option}", str(count)]
    if planner:
        arguments += ["--planner"]
        for option in ("prefill_workers", "decode_workers"):
            if getattr(config, option) is not None:
                arguments += [f"--{option.replace('_', '-')}", getattr(config, option)]
    return arguments


class ServerProcess:
    """``kvmove-serve`` with ``arguments``, in its own session (so that it and every worker it
    starts can be killed as a group), on a free port of 127.0.0.1, ``env`` added to its
    environment. A context manager: entering waits for the ready line, leaving stops it;
    every wait has ``timeout``."""

    def __init__(self, arguments: list[str], timeout: float,
                 env: dict[str, str] | None = None) -> None:
        self.command = [sys.executable, "-m", "kvmove.serve.cli", *arguments,
                        "--host", "127.0.0.1", "--port", str(_free_port("127.0.0.1"))]
        self.env = env or {}
        self.timeout = timeout
        self.url = ""
        self.startup_seconds = math.nan
        self.exit_code: int | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would block it
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        start = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=self._stderr,
                                         text=True, start_new_session=True,
                                         env={**os.environ, "PYTHONSAFEPATH": "1",
                                              **self.env})
        except BaseException:
            self._stderr.close()
            raise
        threading.Thread(target=self._read_stdout, daemon=True).start()
        try:
            self.url = self._wait_ready(start + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_stdout(self) -> None:
        """Drains the server's stdout (a full pipe would block it); None marks its end, when
        the server and every process that inherited the pipe are gone."""
        assert self.proc is not None and self.proc.stdout is not None
        with self.proc.stdout as stdout:
            for line in stdout:
                self._lines.put(line)
        self._lines.put(None)

    def _wait_ready(self, deadline: float) -> str:
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise BenchError(f"kvmove-serve was not ready after {self.timeout:g} s: "
                                 f"{self.stderr_tail()}") from None
            if line is None:
                code = self.proc.wait(self.timeout) if self.proc else None
                raise BenchError(f"kvmove-serve exited with status {code} before it was "
                                 f"ready: {self.stderr_tail()}")
            if line.startswith(READY):
                return line[len(READY):].split()[0].rstrip("/")

    def stderr_tail(self, num_lines: int = 15) -> str:
        self._stderr.seek(0)
        return "".join(self._stderr.readlines()[-num_lines:]).strip() or "(no stderr)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session after ``timeout``; whatever of the
        session outlives the server (a worker it did not stop) is killed too."""
        proc, self.proc = self.proc, None
        try:
            if proc is None:
                return
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                logger.warning("kvmove-serve did not stop %g s after SIGTERM; killing it",
                               self.timeout)
            finally:
                if proc.returncode is None:  # past the deadline, or interrupted waiting
                    _kill_session(proc.pid)
                    self.exit_code = proc.wait(self.timeout)
            if _kill_session(proc.pid):
                logger.warning("kvmove-serve (pid %d) left processes behind; killed them",
                               proc.pid)
        finally:
            self._stderr.close()


def _kill_session(pgid: int) -> bool:
    """SIGKILL to every process of the group ``pgid``; whether there was any."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True
