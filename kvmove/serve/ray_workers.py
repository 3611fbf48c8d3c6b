"""``kvmove-serve --ray [ADDRESS]``: each worker process the child of a Ray actor that Ray
places by resources.

Ray decides where a worker runs, and owns its life; everything else is as with the local
launcher. The actor (``_WorkerActor``) starts ``worker_main`` as its child, with
``PR_SET_PDEATHSIG`` so the worker dies with it when Ray kills it (``ray.kill``, a lost node,
the router's driver gone: the actors are not detached, so they die with the job that made
them). The worker connects to the router's control socket, over tcp on the router's Ray node
address, and says ``ready`` with its kvmove agent's address, which the router passes on, as
with local workers: KV metadata goes through the router, the KV itself between the agents.

The router sees a worker's death on ``RayProcess.poll``: the actor's ``wait`` call, pending
while the worker runs, is ready once the worker exited (its exit code) or the actor died
(``RayActorError``: reported as -9, the worker was SIGKILLed with it). ``ray.wait`` with
timeout 0 never blocks the router's loop; every ``ray.get`` is on a ready reference and still
has a deadline.

Ray is imported only here (the ``kvmove[ray]`` extra): ``kvmove.serve`` imports without it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from typing import Any

from kvmove.errors import ConfigError, KVMoveError
from kvmove.serve.config import LOOPBACK_HOSTS, ServeConfig

__all__ = ["RayLauncher", "RayProcess", "default_resources"]

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvmove[ray]'"
# Ray's switch that keeps a node on the loopback address (its name is about laptops: Ray
# otherwise resolves 127.0.0.1 to the host's primary address, which may not be reachable).
LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
REACH_SECONDS = 5.0   # the cluster's address must accept a connection within this
GET_SECONDS = 10.0    # a ray.get of a reference that ray.wait found ready
SPAWN_SECONDS = 30.0  # an actor starting its worker process
ACTOR_CONCURRENCY = 4  # wait() blocks for the worker's life; info() and terminate() run beside
_PR_SET_PDEATHSIG = 1


def default_resources(role: str, cluster: dict[str, float]) -> dict[str, float]:
    """A worker's Ray resources unless ``--ray-resources`` says: one CPU and one of the
    role's own custom resource (``{"prefill": 1}``: nodes started with it take that role),
    or, where no node declares that resource and the cluster has GPUs, one GPU."""
    if not cluster.get(role) and cluster.get("GPU"):
        return {"CPU": 1, "GPU": 1}
    return {"CPU": 1, role: 1}


def _import_ray(loopback: bool) -> Any:
    if loopback:  # read when ray is first imported
        os.environ.setdefault(LOOPBACK_VARIABLE, "0")
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray ADDRESS must be HOST:PORT (a Ray cluster's GCS), got "
                          f"{address!r}")
    return host.strip("[]"), int(port)


def _reachable(address: str) -> None:
    """Fails fast on an address nobody listens on (ray.init would retry for minutes)."""
    host, port = _host_port(address)
    try:
        socket.create_connection((host, port), timeout=REACH_SECONDS).close()
    except OSError as error:
        raise KVMoveError(f"cannot reach the Ray cluster at {address}: {error}") from None


class RayLauncher:
    """Starts each worker as a Ray actor's child; ``close`` disconnects from Ray (and stops
    the Ray it started for ``--ray`` without an address)."""

    local = False

    def __init__(self, config: ServeConfig) -> None:
        address = config.ray
        assert address is not None
        local = address == "local"
        if not local:
            _reachable(address)
        self.ray = ray = _import_ray(local or _host_port(address)[0] in LOOPBACK_HOSTS)
        self.prefix = f"kvmove-serve-{uuid.uuid4().hex[:8]}"  # its actors' names
        self._starts = 0
        if local:
            self._init_local(config)
        else:
            ray.init(address=address, log_to_driver=True)
        self.control_host = ray.util.get_node_ip_address()
        cluster = ray.cluster_resources()
        given = config.ray_resources or {}
        # Keyed by the roles' plain strings, as Ray's resources and these messages show them
        # (a Role's repr is not its string).
        self.resources = {role: given.get(role) or default_resources(role, cluster)
                          for role in map(str, config.pools())}
        self._check_fits(config, cluster)
        self._actor = ray.remote(_WorkerActor)
        logger.info("Ray: workers' resources %s; control socket on %s", self.resources,
                    self.control_host)

    def _init_local(self, config: ServeConfig) -> None:
        """A Ray on this host, with the role resources its workers ask for by default."""
        counts: dict[str, float] = {}
        for _, role in config.roles():
            counts[str(role)] = counts.get(str(role), 0) + 1
        self.ray.init(address="local", num_cpus=max(os.cpu_count() or 1, len(config.roles())),
                      resources=counts, include_dashboard=False, log_to_driver=True)

    def _check_fits(self, config: ServeConfig, cluster: dict[str, float]) -> None:
        need: dict[str, float] = {}
        for _, role in config.roles():
            for name, amount in self.resources[role].items():
                need[name] = need.get(name, 0) + amount
        short = [f"{amount:g} {name!r} (it has {cluster.get(name, 0):g})"
                 for name, amount in need.items() if amount > cluster.get(name, 0)]
        if short:
            self.close()
            raise ConfigError(
                f"the workers need, in all, more than the Ray cluster has: {', '.join(short)}; "
                f"per worker {self.resources}. Add nodes that have them (ray start "
                "--num-cpus/--num-gpus/--resources '{\"prefill\": 1}') or ask for others "
                "(--ray-resources ROLE=JSON)")

    def start(self, name: str, role: str, command: list[str],
              env: dict[str, str]) -> RayProcess:
        """The actor runs ``command`` with its own node's Python (command[0] is ours)."""
        self._starts += 1
        amounts = dict(self.resources[role])
        options = {"num_cpus": amounts.pop("CPU", 0), "num_gpus": amounts.pop("GPU", 0),
                   "resources": amounts, "max_restarts": 0,
                   "max_concurrency": ACTOR_CONCURRENCY,
                   "name": f"{self.prefix}-{name}-{self._starts}"}
        actor = self._actor.options(**options).remote(
            name, command[1:], {"PYTHONSAFEPATH": "1", **env})
        return RayProcess(self.ray, actor, name)

    def close(self) -> None:
        self.ray.shutdown()


class RayProcess:
    """A worker process run by a Ray actor, as ``subprocess.Popen`` would show it."""

    def __init__(self, ray: Any, actor: Any, name: str) -> None:
        self.ray, self.actor, self.name = ray, actor, name
        self.returncode: int | None = None
        self._exit = actor.wait.remote()
        self._info_ref = actor.info.remote()
        self._info: dict[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        """The worker's pid on its node (None until its actor said)."""
        return self._where().get("pid")

    @property
    def node(self) -> str | None:
        """The Ray node id the worker runs on (None until its actor said)."""
        return self._where().get("node")

    def _where(self) -> dict[str, Any]:
        if self._info is None and self.ray.wait([self._info_ref], timeout=0)[0]:
            try:
                self._info = self.ray.get(self._info_ref, timeout=GET_SECONDS)
            except self.ray.exceptions.RayError:
                self._info = {}  # the actor died first
        return self._info or {}

    def poll(self) -> int | None:
        if self.returncode is None and self.ray.wait([self._exit], timeout=0)[0]:
            self.returncode = self._exit_code()
            self.kill()  # a worker that exited leaves an idle actor holding its resources
        return self.returncode

    def _exit_code(self) -> int:
        try:
            return self.ray.get(self._exit, timeout=GET_SECONDS)
        except self.ray.exceptions.RayError as error:
            summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
            logger.warning("the Ray actor of worker %s died: %s: %s", self.name,
                           type(error).__name__, summary)
            return -signal.SIGKILL  # its worker was killed with it (PR_SET_PDEATHSIG)

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = self.ray.wait([self._exit], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.name, timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def terminate(self) -> None:
        """SIGTERM to the worker (through its actor)."""
        if self.returncode is None:
            self.actor.terminate.remote()

    def kill(self) -> None:
        """Kills the actor, and with it the worker."""
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception as error:  # noqa: BLE001 - already gone
            logger.debug("ray.kill(%s): %s", self.name, error)


def _die_with_parent(parent: int) -> None:
    """In the worker before exec: SIGKILL when the actor (its parent thread) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the actor died before prctl
        os._exit(1)


class _WorkerActor:
    """One worker process as this actor's child. It is started and waited for by a thread of
    its own: PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, and this
    one ends only after the child. Its output goes to the actor's (Ray's logs, which Ray
    forwards to the router's driver, prefixed with this actor's ``repr``: the worker's name).
    """

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.process: subprocess.Popen | None = None
        self.code: int | None = None
        self.error = ""
        self._spawned, self._exited = threading.Event(), threading.Event()
        threading.Thread(target=self._run, args=(args, env), name=f"{name}-process",
                         daemon=True).start()
        if not self._spawned.wait(SPAWN_SECONDS) or self.process is None:
            raise KVMoveError(f"worker {name} did not start: {self.error or 'timed out'}")

    def _run(self, args: list[str], env: dict[str, str]) -> None:
        parent = os.getpid()
        try:
            self.process = subprocess.Popen(
                [sys.executable, *args], stdin=subprocess.DEVNULL, env={**os.environ, **env},
                preexec_fn=lambda: _die_with_parent(parent))
        except OSError as error:
            self.error = str(error)
            return
        finally:
            self._spawned.set()
        self.code = self.process.wait()
        self._exited.set()

    def __repr__(self) -> str:
        return self.name

    def info(self) -> dict[str, Any]:
        import ray

        assert self.process is not None
        return {"pid": self.process.pid, "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def wait(self) -> int | None:
        """Returns once the worker exited: its exit code."""
        self._exited.wait()
        return self.code

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
