"""``kvmove-serve`` as a real process, for ``test_serve.py``.

``Server`` starts ``python -m kvmove.serve.cli`` on a free port, waits for its ``ready`` line,
records its worker processes' pids (from ``/health``) and stops it: a signal, a deadline, then
SIGKILL for the server *and* every process it started, so a broken shutdown fails the test
instead of leaking processes. Every process a ``Server`` starts carries a tag in its
environment, so its workers are found whether or not ``/health`` lists them.
``ServerPool`` shares one server per configuration across a test module and starts a fresh
one when a test has taken the shared one away (to kill a worker of it, or stop it).

Every wait has a deadline: a hung server fails the test, it never hangs the run.
"""

from __future__ import annotations

import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from helpers.checks import WORKDIR, wait_until  # noqa: F401 - wait_until: the serve tests import it here

READY_PREFIX = "kvmove-serve ready on "
TAG_VARIABLE = "KVMOVE_SERVE_TEST_TAG"  # inherited by the workers
WORKER_MARKER = "kvmove.serve.worker_main"
START_SECONDS = 90.0    # the server and each worker import torch; 2 cores
STOP_SECONDS = 30.0     # graceful: the router tells each worker to exit, then waits for it
GONE_SECONDS = 10.0     # once the server has exited, no process of it is left
HTTP_SECONDS = 30.0     # one request, or the gap between two stream chunks


def process_alive(pid: int, marker: str = WORKER_MARKER) -> bool:
    """True while ``pid`` runs (a zombie does not count) with ``marker`` in its command line
    (so a recycled pid, now another program's, does not count either)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except (OSError, IndexError):
        return False
    return state != "Z" and marker in cmdline


def tagged_pids(tag: str) -> list[int]:
    """Running processes whose environment has ``TAG_VARIABLE=tag``: one ``Server``'s."""
    entry = f"{TAG_VARIABLE}={tag}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry not in f.read().split(b"\0"):
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if process_alive(int(name), marker=""):
            pids.append(int(name))
    return pids


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


class Server:
    """One ``kvmove-serve`` process (and, through it, its workers)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 engine: bool = True, max_fds: int | None = None,
                 netns: str | None = None) -> None:
        """``engine`` False: a vLLM proxy (``--vllm-*`` in ``args``), no model, no workers.
        ``max_fds``: the server's (and its workers') file-descriptor limit, soft and hard.
        ``netns``: run it in that network namespace (another "host"; give it a ``--host``
        this one reaches)."""
        self.args = ["--port", "0", *(["--model", "tiny"] if engine else []), *args]
        self.tag = uuid.uuid4().hex
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe cannot block it
        where = ["ip", "netns", "exec", netns] if netns else []
        self.process = subprocess.Popen(
            [*where, sys.executable, "-m", "kvmove.serve.cli", *self.args], cwd=WORKDIR,
            text=True,
            stdout=subprocess.PIPE, stderr=self.stderr,
            env={**os.environ, **(env or {}), TAG_VARIABLE: self.tag, "PYTHONUNBUFFERED": "1"},
            preexec_fn=None if max_fds is None else lambda: resource.setrlimit(
                resource.RLIMIT_NOFILE, (max_fds, max_fds)))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.worker_pids: list[int] = []
        self._clients: list[openai.OpenAI] = []
        try:
            self.url = self._wait_ready()
            if engine:
                self.worker_pids = [w["pid"] for w in self.health()["workers"]]
        except BaseException:
            self.kill()
            raise

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"kvmove-serve {self.args} not ready after "
                                     f"{START_SECONDS:g} s\n{self.stderr_text()}") from None
            if line is None:
                raise AssertionError(f"kvmove-serve {self.args} exited before it was ready "
                                     f"(code {self.process.wait(STOP_SECONDS)})\n"
                                     f"{self.stderr_text()}")
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].split()[0]

    def stderr_text(self, tail: int | None = 4000) -> str:
        """The server's stderr (its log, its workers' relayed): the last ``tail`` characters,
        or all of it."""
        self.stderr.seek(0)
        text = self.stderr.read()
        return text[-tail:] if tail is not None else text

    def __repr__(self) -> str:
        return f"Server({' '.join(self.args)})"

    # --- clients --------------------------------------------------------------------------

    def client(self, timeout: float = HTTP_SECONDS) -> openai.OpenAI:
        """The official client; no retries, so every error reaches the test."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                               timeout=timeout)
        self._clients.append(client)
        return client

    def async_client(self, timeout: float = HTTP_SECONDS) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=HTTP_SECONDS)

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=HTTP_SECONDS, **kwargs)

    def health(self) -> dict:
        return self.get("/health").json()

    def worker(self, name: str) -> dict:
        return next(w for w in self.health()["workers"] if w["name"] == name)

    def samples(self) -> dict[tuple[str, tuple], float]:
        """``/metrics`` through prometheus_client's parser: (sample name, sorted labels) ->
        value."""
        response = self.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/plain")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(response.text)
                for s in family.samples}

    def control_address(self) -> str:
        """The router's control endpoint, from a worker's command line (``--router``)."""
        with open(f"/proc/{self.worker_pids[0]}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
        return args[args.index("--router") + 1]

    # --- shutdown -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, seconds: float = STOP_SECONDS) -> int | None:
        """Sends ``sig`` and waits; the exit code, or None if it had to be killed."""
        if self.running:
            self.process.send_signal(sig)
            try:
                return self.process.wait(seconds)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL for the server and every process it started: nothing is left running."""
        if self.running:
            self.process.kill()
            self.process.wait(STOP_SECONDS)
        for pid in {*self.worker_pids, *tagged_pids(self.tag)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def left_behind(self) -> list[int]:
        """Processes of this server still running: its listed workers, and anything tagged."""
        return sorted({*(p for p in self.worker_pids if process_alive(p)),
                       *tagged_pids(self.tag)})

    def wait_gone(self, seconds: float = GONE_SECONDS) -> None:
        wait_until(lambda: not self.left_behind(), seconds,
                   lambda: f"{self}: every process gone (still running: "
                           f"{[(pid, _command_line(pid)) for pid in self.left_behind()]})")

    def close(self) -> None:
        """Stops the server if it runs (SIGTERM); fails if it had to be killed or left a
        process behind. Kills whatever is left either way."""
        try:
            if self.running:
                code = self.stop()
                assert code is not None, f"{self} still running {STOP_SECONDS:g} s after SIGTERM"
            self.wait_gone()
        finally:
            self.kill()
            for client in self._clients:
                client.close()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.stderr.close()


class ServerPool:
    """One shared ``Server`` per configuration, started on first use; ``take`` hands a test
    the shared one to damage or stop (and close), and the next ``get`` starts a fresh one."""

    def __init__(self, configs: dict[str, tuple[str, ...]]) -> None:
        self.configs = configs
        self.servers: dict[str, Server] = {}
        self.taken: list[Server] = []

    def get(self, name: str) -> Server:
        server = self.servers.get(name)
        if server is None or not server.running:
            if server is not None:
                self.taken.append(server)
            server = self.servers[name] = Server(*self.configs[name])
        return server

    def take(self, name: str) -> Server:
        """The shared server (started if need be), now the caller's alone to close."""
        server = self.get(name)
        del self.servers[name]
        return server

    def close(self) -> None:
        """Stops every server; fails listing each one that did not stop cleanly."""
        errors = []
        for server in [*self.servers.values(), *self.taken]:
            try:
                server.close()
            except AssertionError as error:
                errors.append(str(error))
        self.servers, self.taken = {}, []
        assert not errors, errors
