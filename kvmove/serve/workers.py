"""The router's worker processes: how one is started (its command line, cores and control
identity), what the router knows of it, its output, relayed into the router's log, and how
one is ended.

Where a worker's process runs is its launcher's business: ``LocalLauncher`` (the default)
starts it as the router's child on this host; ``ray_workers.RayLauncher`` (``--ray``) as the
child of a Ray actor placed by Ray. Either hands back a handle with ``subprocess.Popen``'s
``pid``, ``poll``, ``returncode``, ``wait``, ``terminate`` and ``kill``, which is all the
router uses, so it does not care which.

A worker's stdout and stderr were thrown away (``subprocess.DEVNULL``), so a worker that
failed said nothing. Now a thread per stream reads them line by line and logs each line on
the ``kvmove.serve.worker`` logger with the worker's name in it. Workers log in
``LINE_FORMAT``; a line in that form keeps its level, any other line (a print, a traceback)
is logged at INFO from stdout and WARNING from stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from kvmove.engine.role import Role
from kvmove.serve.config import Mode, ServeConfig
from kvmove.serve.control import IDENTITY_VARIABLE, new_identity
from kvmove.serve.messages import Stats

__all__ = ["LINE_FORMAT", "Launcher", "LocalLauncher", "WorkerInfo", "cpu_shares",
           "end_process", "launcher_for", "worker_command"]

LINE_FORMAT = "%(levelname)s %(name)s: %(message)s"
MAX_LINE_BYTES = 64 * 1024  # a longer line is logged in pieces
_LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR",
                                                      "CRITICAL")}
output_logger = logging.getLogger("kvmove.serve.worker")


class Launcher(Protocol):
    """Starts worker processes somewhere, and says how the router can be reached from there."""

    local: bool  # its workers are this host's processes (they may be pinned to its cores)
    control_host: str | None  # where the control socket listens (None: the private ipc one)

    def start(self, name: str, role: Role, command: list[str], env: dict[str, str]) -> Any:
        """Starts ``command`` (``env`` added to the environment); a Popen-like handle."""
        ...

    def close(self) -> None:
        """After the router stopped every worker."""
        ...


class LocalLauncher:
    """Each worker a child process of the router, on this host."""

    local = True
    control_host: str | None = None  # the private ipc socket

    def start(self, name: str, role: Role, command: list[str],
              env: dict[str, str]) -> subprocess.Popen:
        # PYTHONSAFEPATH: run from a source checkout, `-m` would import the checkout's kvmove
        # (without its compiled core) instead of the installed one
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={**os.environ, "PYTHONSAFEPATH": "1", **env})
        for stream, level in ((process.stdout, logging.INFO),
                              (process.stderr, logging.WARNING)):
            threading.Thread(target=_relay, args=(stream, name, level),
                             name=f"{name}-output", daemon=True).start()
        return process

    def close(self) -> None:
        pass


def launcher_for(config: ServeConfig) -> Launcher:
    """``config.ray``'s launcher (ray is imported only then), else the local one."""
    if config.ray is None:
        return LocalLauncher()
    from kvmove.serve.ray_workers import RayLauncher

    return RayLauncher(config)


@dataclass(eq=False)
class WorkerInfo:
    """One worker as the router sees it (across restarts: one name, a process after
    another, each with its own identity)."""

    name: str
    role: Role
    command: list[str]
    launcher: Launcher = field(default_factory=LocalLauncher)
    process: Any = None  # the launcher's handle: a subprocess.Popen, or Popen-like
    identity: bytes = b""   # the current process's, on the control channel
    agent: tuple[str, int] | None = None
    ready: bool = False
    alive: bool = False
    registered: bool = False  # its "ready" event came: its agent listens
    stats: Stats | None = None
    requests: set[str] = field(default_factory=set)
    restarts: int = 0
    draining: bool = False  # the planner takes it out: no new requests, then it is shut down
    retired: bool = False   # drained and ended: not started again, not reported
    # (name, pid) of the other pool's workers this one is a kvmove peer of, each incarnation
    # (pid None: a Ray worker's, before its actor said)
    peers: set[tuple[str, int | None]] = field(default_factory=set)
    # Blocks taken on it that its last stats may not show yet (a decode worker): asked for
    # (rid → the router's estimate, no reply yet), and granted since its last stats. Its
    # channel is ordered: stats that come after a grant count it.
    asked_blocks: dict[str, int] = field(default_factory=dict)
    granted_blocks: int = 0

    @property
    def pid(self) -> int | None:
        """The current process's (None before the first start)."""
        return self.process.pid if self.process is not None else None

    @property
    def node(self) -> str | None:
        """Where its process runs: a Ray node's id under Ray, None for this host."""
        return getattr(self.process, "node", None)

    @property
    def listening(self) -> bool:
        """Its process runs and has registered: its agent listens (a peer can connect)."""
        return self.alive and self.registered

    @property
    def load(self) -> int:
        return len(self.requests)

    @property
    def free_blocks(self) -> int:
        """Its free blocks as its last stats said, less those taken since (``asked_blocks``,
        ``granted_blocks``): a burst of reservations does not all pick the same worker."""
        return self.stat("free_blocks") - self.granted_blocks - sum(self.asked_blocks.values())

    def reported(self, stats: Stats) -> None:
        self.stats, self.granted_blocks = stats, 0

    def stat(self, name: str) -> int:
        """A number of its last stats event (0 before the first)."""
        return getattr(self.stats, name) if self.stats is not None else 0

    def start(self) -> None:
        """Starts its process (again: then everything its last one reported is forgotten)
        under a new identity, and relays its output into the log."""
        self.ready, self.registered, self.agent, self.stats = False, False, None, None
        self.peers.clear()
        self.asked_blocks.clear()
        self.granted_blocks = 0
        self.identity = new_identity(self.name)
        self.process = self.launcher.start(self.name, self.role, self.command,
                                           {IDENTITY_VARIABLE: self.identity.decode()})
        self.alive = True


def _relay(stream: IO[bytes], name: str, default: int) -> None:
    """Logs ``stream``'s lines until its end (the process exited)."""
    with stream:
        for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
            line = raw.decode(errors="replace").rstrip("\n")
            level_name, _, rest = line.partition(" ")
            level = _LEVELS.get(level_name)
            output_logger.log(level or default, "[%s] %s", name, rest if level else line)


def worker_command(config: ServeConfig, name: str, role: Role, cpus: list[int],
                   address: str) -> list[str]:
    """The command line of worker ``name`` (role ``role``, pinned to ``cpus``), which
    connects to the router's control socket at ``address``."""
    c = config
    command = [sys.executable, "-m", "kvmove.serve.worker_main", "--name", name,
               "--role", str(role), "--router", address, "--model", c.model,
               "--num-blocks", str(c.num_blocks), "--block-size", str(c.block_size),
               "--chunk-size", str(c.chunk_size if c.mode != Mode.COLOCATED else 0),
               "--max-num-seqs", str(c.max_num_seqs),
               "--max-num-batched-tokens", str(c.max_num_batched_tokens),
               "--agent-host", c.agent_host, "--transfer-timeout", str(c.transfer_timeout),
               "--log-level", c.log_level]
    if c.transports:
        command += ["--transports", c.transports]
    if c.net_devices:
        command += ["--net-devices", c.net_devices]
    if c.key_file:
        command += ["--key-file", os.path.abspath(c.key_file)]
    if c.checksums and role == Role.PREFILL:
        command += ["--checksums"]
    command += c.store_args(name, role)
    if cpus:
        command += ["--cpus", ",".join(map(str, cpus))]
    return command


def cpu_shares(num_workers: int) -> list[list[int]]:
    """Disjoint CPU sets, one per worker, when every worker can have at least one core (an
    engine instance on a real cluster has its own GPU; here its own cores); otherwise no
    pinning (empty sets) and the OS shares the cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_workers > len(cpus):
        return [[] for _ in range(num_workers)]
    each = len(cpus) // num_workers
    return [cpus[i * each:(i + 1) * each] for i in range(num_workers)]


async def end_process(process: Any, deadline: float) -> None:
    """Waits for ``process`` until ``deadline``, then terminates it, then kills it."""
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(3)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(3)
