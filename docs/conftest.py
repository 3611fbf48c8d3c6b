"""Fixtures for the code blocks of docs/*.md, which pytest-markdown-docs runs as tests
(`pytest` from the repository root; pyproject.toml's [tool.pytest.ini_options]).

A block asks for one with the fence option ``fixture:NAME`` (a fence opening with
``{.python fixture:NAME}``) and finds its value as the global ``NAME``. They stand in for
what a block cannot make itself on a CPU-only machine without a network: an engine's own KV
objects (SGLang's pool), a running ``kvmove-serve``, and the GPU that ``docs/gpu.md`` needs
(its blocks skip without one, as the tests marked ``gpu`` do). README.md's blocks need none
of them: they run from the repository root, where no conftest.py may live (pytest would put
the root on sys.path and import the checkout's kvmove/, which has no compiled core in a
non-editable install).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import IO

import pytest

import kvmove

SERVE_START_SECONDS = 120.0   # the router and each worker import torch; 2 shared cores in CI
SERVE_STOP_SECONDS = 30.0
READY_PREFIX = "kvmove-serve ready on "


@pytest.fixture
def token_to_kv_pool() -> SimpleNamespace:
    """SGLang's ``MHATokenToKVPool`` for Llama-3.1-8B (the attributes kvmove reads): per layer
    a K and a V buffer ``[num_tokens, num_kv_heads, head_dim]`` float16, paged by
    ``page_size`` tokens; 16 pages of 16 tokens."""
    import torch

    page_size, num_tokens = 16, 16 * 16

    def buffers() -> list[torch.Tensor]:
        return [torch.zeros(num_tokens, 8, 128, dtype=torch.float16) for _ in range(32)]

    return SimpleNamespace(k_buffer=buffers(), v_buffer=buffers(), page_size=page_size)


@pytest.fixture
def gpu() -> str:
    """``"cuda:0"``; skips the block, naming why, unless kvmove was built with CUDA and both
    kvmove and torch see a device (as ``tests/test_gpu.py`` does)."""
    import torch

    status = kvmove.cuda_status()
    if status.device_count == 0:
        pytest.skip(f"no CUDA device for kvmove: {status.reason}")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (a CPU build of torch)")
    return "cuda:0"


@pytest.fixture
def base_url() -> Iterator[str]:
    """The OpenAI API of a ``kvmove-serve --mode disagg --prefill 1 --decode 1 --model tiny``
    started for the block, on a free port (docs/serving.md shows it on 8000), stopped after.

    It runs from a temporary directory: from the repository root, ``python -m`` would import
    the checkout's kvmove/ instead of the installed one. Its own session, so that whatever it
    started can be killed with it if it does not stop."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "kvmove.serve.cli", "--mode", "disagg", "--prefill", "1",
             "--decode", "1", "--model", "tiny", "--port", "0"],
            cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=stderr, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            yield f"{_wait_ready(server, stderr)}/v1"
        finally:
            _stop(server)


def _wait_ready(server: subprocess.Popen, stderr: IO[str]) -> str:
    """The server's URL from its ready line; fails with its stderr if it exits or is late."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:  # to the end: a full pipe would block the server
        for line in server.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + SERVE_START_SECONDS
    while (left := deadline - time.monotonic()) > 0 and server.poll() is None:
        try:
            line = lines.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if line.startswith(READY_PREFIX):
            return line[len(READY_PREFIX):].split()[0]
    stderr.seek(0)
    pytest.fail(f"kvmove-serve not ready (exit code {server.poll()}):\n{stderr.read()[-4000:]}")


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM (the server stops its workers), then SIGKILL for its whole session."""
    server.send_signal(signal.SIGTERM)
    # tests/test_serve.py holds the shutdown to account; here it only must not linger.
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(SERVE_STOP_SECONDS)
    with contextlib.suppress(ProcessLookupError):  # none left of its session: all is well
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
