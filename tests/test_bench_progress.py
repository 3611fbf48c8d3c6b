"""Progress of ``kvmove-bench`` runs (``kvmove/bench/progress.py``): a bar on stderr when a
person watches a terminal, silence when the JSON report goes to a pipe. Real processes with
real pipes and pseudo-terminals; ``kvmove-bench stream`` on a 64-token prompt is the run
(about 3 s here)."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest

from kvmove.bench import progress

from helpers.checks import WORKDIR

STREAM_TINY = ["stream", "--model", "llama-3.2-1b", "--tokens", "64", "--iters", "1"]
RUN_SECONDS = 180


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(
    ("stderr_tty", "stdout_tty", "json", "shown"),
    [(True, True, False, True), (True, False, False, True),  # text piped: stderr still seen
     (True, True, True, True), (True, False, True, False),   # JSON to a pipe: silent
     (False, True, False, False), (False, False, True, False)],
)
def test_the_rule(monkeypatch: pytest.MonkeyPatch, stderr_tty: bool, stdout_tty: bool,
                  json: bool, shown: bool) -> None:
    monkeypatch.setattr(sys, "stderr", _Stream(stderr_tty))
    monkeypatch.setattr(sys, "stdout", _Stream(stdout_tty))
    assert progress.wanted(argparse.Namespace(command="stream", json=json)) is shown


def _read_all(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed its end of the terminal
            return
        if not chunk:
            return
        into.append(chunk)


def _run_with_terminal_stderr(*args: str) -> tuple[int, str, str]:
    """Runs kvmove-bench with stderr on a pseudo-terminal and stdout on a pipe; returns
    (status, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    # A fresh pseudo-terminal is 0 columns wide, where tqdm draws nothing; a person's is not.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen([sys.executable, "-m", "kvmove.bench.cli", *args],
                             stdout=subprocess.PIPE, stderr=slave, text=True, cwd=WORKDIR)
    os.close(slave)
    shown: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(master, shown), daemon=True)
    reader.start()
    try:
        out, _ = child.communicate(timeout=RUN_SECONDS)
    finally:
        child.kill()
        reader.join(timeout=10)
        os.close(master)
    return child.returncode, out, b"".join(shown).decode(errors="replace")


def test_a_terminal_shows_the_bar() -> None:
    status, out, terminal = _run_with_terminal_stderr(*STREAM_TINY)
    assert status == 0, terminal
    assert "kvmove-bench stream: 100%" in terminal
    assert "kvmove-bench stream:" not in out and "hidden" in out  # the report, alone


def test_json_to_a_pipe_is_silent_even_before_a_terminal() -> None:
    status, out, terminal = _run_with_terminal_stderr(*STREAM_TINY, "--json")
    assert status == 0, terminal
    assert "kvmove-bench stream" not in terminal
    assert out.lstrip().startswith("{")


def test_everything_piped_is_silent() -> None:
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", *STREAM_TINY, "--json"],
                            capture_output=True, text=True, cwd=WORKDIR,
                            timeout=RUN_SECONDS)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
