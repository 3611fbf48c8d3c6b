"""One ``kvmove.serve.worker_main`` process with the test as its router: the test binds the
ROUTER socket, starts the worker with an identity, and sends it whatever frames it likes.

Every wait has a deadline; ``close`` asks the worker to exit, then kills it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import zmq

from kvmove.serve.control import IDENTITY_VARIABLE

from helpers.serve import WORKDIR

START_SECONDS = 90.0  # the worker imports torch and builds its engine; 2 cores
EVENT_SECONDS = 10.0


class WorkerHarness:
    """A worker of ``role`` (the tiny preset, 64 blocks of 16 tokens) driven by hand."""

    def __init__(self, role: str = "prefill", name: str = "prefill-0") -> None:
        self.directory = tempfile.mkdtemp(prefix="kvmove-test-")
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{self.directory}/control"
        self.socket.bind(self.address)
        self.identity = f"{name}/test".encode()
        command = [sys.executable, "-m", "kvmove.serve.worker_main", "--name", name,
                   "--role", role, "--router", self.address, "--model", "tiny",
                   "--num-blocks", "64", "--block-size", "16"]
        self.process = subprocess.Popen(
            command, cwd=WORKDIR, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env={**os.environ, "PYTHONSAFEPATH": "1",
                                         IDENTITY_VARIABLE: self.identity.decode()})
        try:
            self.ready = self.event("ready", START_SECONDS)
        except BaseException:
            self.close()
            raise

    def send(self, *frames: bytes) -> None:
        """The frames after the identity frame (one frame of JSON, for a valid command)."""
        self.socket.send_multipart([self.identity, *frames])

    def event(self, kind: str, seconds: float = EVENT_SECONDS) -> dict:
        """The next event of ``kind`` (others are skipped), within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(left * 1000):
                raise AssertionError(f"no {kind!r} event from the worker after {seconds:g} s "
                                     f"(alive: {self.process.poll() is None})")
            identity, payload = self.socket.recv_multipart()
            assert identity == self.identity, identity
            event = json.loads(payload)
            if event["ev"] == kind:
                return event

    def close(self) -> int | None:
        """Asks the worker to exit; its exit code (None: it had to be killed)."""
        code = None
        try:
            if self.process.poll() is None:
                self.send(b'{"op": "shutdown"}')
                code = self.process.wait(EVENT_SECONDS)
            else:
                code = self.process.returncode
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(EVENT_SECONDS)
        finally:
            self.socket.close()
            self.context.term()
            if self.process.stderr is not None:
                self.process.stderr.close()
            shutil.rmtree(self.directory, ignore_errors=True)
        return code
