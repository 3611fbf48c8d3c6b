"""``ucx_perftest`` as a baseline: UCX's own put/get bandwidth and put latency on this machine.

The libucx wheel ships ``bin/ucx_perftest`` next to ``lib/``. We run it the way its manual
does for two processes: a server (``ucx_perftest -p PORT``) and a client
(``ucx_perftest 127.0.0.1 -p PORT -t TEST ...``) on loopback (or, between two machines, the
server on the far one: ``Server``, ``kvmove.bench.remote``), both with the caller's
``UCX_TLS``, the UCX settings every kvmove agent adds for tcp (``agent_ucx_env``: a get over
tcp is 4-6x faster with them, and a baseline without them would flatter kvmove's reads) and,
when the kvmove agents detect peer failure, with ``-e`` (endpoints with error handling) and
the UCX settings kvmove's agents add in that mode, because that mode changes which transports
UCX may use: a baseline on other transports than kvmove's would compare two different links.

Units: ``ucx_perftest`` reports bandwidth in MB/s with MB = 2**20 bytes (``UCS_MBYTE``);
we convert to GB/s with GB = 1e9 bytes, like the rest of kvmove. Its ``ucp_put_lat`` is a
ping-pong and reports half the round trip; we take its median (``50.0_percentile_lat``).

Nothing here raises for a baseline that cannot run (no binary, transport refused, timeout,
unreadable output): the result says ``available=False`` and why, so a benchmark can still
report its own numbers.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvmove import _C

__all__ = ["BANDWIDTH_TESTS", "LocalServer", "PerftestResult", "Server", "bandwidth",
           "environment", "find_binary", "get_bandwidth", "parse_output", "put_bandwidth",
           "put_latency"]

BANDWIDTH_TESTS = ("ucp_put_bw", "ucp_get")


def agent_ucx_env(peer_errors: bool) -> dict[str, str]:
    """The UCX settings a kvmove agent adds to its UCX configuration (its tcp settings, and
    with ``error_mode="peer"`` that mode's), as environment variables (``{"UCX_RNDV_THRESH":
    "inf", ...}``), less those the environment sets already (they win): so that a tool such as
    ``ucx_perftest`` (``-e``), or another library's UCX, runs as the agents' UCX does. Why
    each: ``tcp_settings`` and ``peer_error_settings`` in csrc/transport/ucx.cpp."""
    pairs = [*_C.tcp_settings(), *(_C.peer_error_settings() if peer_errors else [])]
    settings = {f"UCX_{key}": value for key, value in pairs}
    return {name: value for name, value in settings.items() if name not in os.environ}

_MIB = 1 << 20
_MIN_TOTAL_NBYTES = 64 * _MIB
_CONNECT_SECONDS = 10.0  # how long the client retries "connection refused" while the server starts
_SERVER_EXIT_SECONDS = 5.0
# Column order of both output formats: the table's "Final:" row and the CSV (-v) row.
_COLUMNS = ("iterations", "50.0_percentile_lat", "avg_lat", "overall_lat", "avg_bw",
            "overall_bw", "avg_mr", "overall_mr")


@dataclass(frozen=True, slots=True)
class PerftestResult:
    """One ``ucx_perftest`` run, or why it could not run.

    Attributes:
        test: ``"ucp_put_bw"``, ``"ucp_get"`` or ``"ucp_put_lat"``.
        message_nbytes: bytes per operation.
        transports: the ``UCX_TLS`` it ran with (``None``: UCX's choice).
        error_handling: whether it ran with ``-e`` (as kvmove's ``error_mode="peer"``).
        available: False when it could not run; ``reason`` says why.
        gbytes_per_s: bandwidth (1 GB = 1e9 B); ``None`` when unavailable.
        latency_us: median one-way latency (half the ping-pong) for ``ucp_put_lat``.
        iterations: operations measured (after warm-up).
        reason: empty when available.
    """

    test: str
    message_nbytes: int
    transports: str | None
    error_handling: bool
    available: bool
    gbytes_per_s: float | None = None
    latency_us: float | None = None
    iterations: int = 0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_binary() -> str | None:
    """The libucx wheel's ``ucx_perftest``, else one on ``PATH``, else ``None``."""
    try:
        import libucx
    except ImportError:
        libucx = None
    if libucx is not None:
        path = os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_perftest")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("ucx_perftest")


def put_bandwidth(message_nbytes: int, *, total_nbytes: int, transports: str | None = None,
                  error_handling: bool = True, timeout: float = 60.0) -> PerftestResult:
    """``ucp_put_bw`` with ``message_nbytes`` per put, moving about ``total_nbytes`` in all."""
    return bandwidth("ucp_put_bw", message_nbytes, total_nbytes=total_nbytes,
                     transports=transports, error_handling=error_handling, timeout=timeout)


def get_bandwidth(message_nbytes: int, *, total_nbytes: int, transports: str | None = None,
                  error_handling: bool = True, timeout: float = 60.0) -> PerftestResult:
    """``ucp_get`` with ``message_nbytes`` per get, moving about ``total_nbytes`` in all."""
    return bandwidth("ucp_get", message_nbytes, total_nbytes=total_nbytes,
                     transports=transports, error_handling=error_handling, timeout=timeout)


def bandwidth(test: str, message_nbytes: int, *, total_nbytes: int,
              transports: str | None = None, error_handling: bool = True,
              timeout: float = 60.0, server: Server | None = None) -> PerftestResult:
    """A bandwidth ``test`` (``ucp_put_bw`` or ``ucp_get``) moving about ``total_nbytes``.

    The run is sized by bytes rather than a fixed count so a 4 KiB and a 16 MiB message take
    similar times: at least ``_MIN_TOTAL_NBYTES`` and 16 operations, at most 100,000, plus a
    tenth of that as warm-up. (A 2 MB total at 32 KiB is 64 gets: too short to mean anything.)
    ``server``: where ucx_perftest's server runs (default: a ``LocalServer`` on loopback).
    """
    if test not in BANDWIDTH_TESTS:
        raise ValueError(f"test must be one of {BANDWIDTH_TESTS}, got {test!r}")
    total_nbytes = max(total_nbytes, _MIN_TOTAL_NBYTES)
    iterations = min(100_000, max(16, math.ceil(total_nbytes / message_nbytes)))
    return _run(test, message_nbytes, iterations, transports, error_handling, timeout, server)


def put_latency(message_nbytes: int = 8, *, iterations: int = 2000,
                transports: str | None = None, error_handling: bool = True,
                timeout: float = 60.0, server: Server | None = None) -> PerftestResult:
    """``ucp_put_lat``: median one-way put latency for ``message_nbytes`` (8 B: the floor)."""
    return _run("ucp_put_lat", message_nbytes, iterations, transports, error_handling, timeout,
                server)


def _run(test: str, message_nbytes: int, iterations: int, transports: str | None,
         error_handling: bool, timeout: float, server: Server | None) -> PerftestResult:
    def unavailable(reason: str) -> PerftestResult:
        return PerftestResult(test, message_nbytes, transports, error_handling, False,
                              reason=reason)

    binary = find_binary()
    if binary is None:
        return unavailable("ucx_perftest not found (neither in the libucx wheel nor on PATH)")
    args = ["-t", test, "-s", str(message_nbytes), "-n", str(iterations),
            "-w", str(max(1, iterations // 10)), "-v", "-f", *(["-e"] if error_handling else [])]
    try:
        env = environment(binary, transports, error_handling)
        values = parse_output(_with_retry(binary, args, env, timeout,
                                          server or LocalServer(binary, env)))
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as error:
        return unavailable(str(error))
    return PerftestResult(test, message_nbytes, transports, error_handling, True,
                          gbytes_per_s=values["overall_bw"] * _MIB / 1e9,
                          latency_us=_median_latency(values) if test == "ucp_put_lat" else None,
                          iterations=int(values["iterations"]))


def _median_latency(values: dict[str, float]) -> float:
    """The percentile column (``-R`` changes its name; 50 by default), else the mean."""
    percentile = [name for name in values if name.endswith("_percentile_lat")]
    return values[percentile[0]] if percentile else values["overall_lat"]


def environment(binary: str, transports: str | None, error_handling: bool) -> dict[str, str]:
    """The caller's environment, the wheel's ``lib/`` first on ``LD_LIBRARY_PATH``,
    ``UCX_TLS`` set to ``transports`` (removed for ``None``, so UCX chooses as kvmove's agents
    do when given none), and the agents' own UCX settings (with ``error_handling``, PEER
    mode's too)."""
    env = dict(os.environ)
    env.update(agent_ucx_env(error_handling))
    lib = os.path.join(os.path.dirname(os.path.dirname(binary)), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (lib, env.get("LD_LIBRARY_PATH", "")) if p)
    if transports:
        env["UCX_TLS"] = transports
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server(Protocol):
    """Where ``ucx_perftest``'s server side runs: ``start`` it (returns the host and port the
    client connects to), ``finish`` (its exit code and output once it exits, within
    ``timeout`` seconds, else ``subprocess.TimeoutExpired``), ``kill`` (whatever state it
    is in; nothing when it finished)."""

    def start(self) -> tuple[str, int]: ...

    def finish(self, timeout: float) -> tuple[int, str]: ...

    def kill(self) -> None: ...


class LocalServer:
    """``ucx_perftest -p PORT`` on this host, reached on loopback (or on ``host``, which a far
    side of ``kvmove-bench transfer --listen`` advertises)."""

    def __init__(self, binary: str, env: dict[str, str], host: str = "127.0.0.1") -> None:
        self.binary, self.env, self.host = binary, env, host
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> tuple[str, int]:
        self.kill()
        port = _free_port()
        self.process = subprocess.Popen([self.binary, "-p", str(port)], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        return self.host, port

    def finish(self, timeout: float) -> tuple[int, str]:
        assert self.process is not None, "finish() before start()"
        out, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err + out

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _with_retry(binary: str, args: list[str], env: dict[str, str], timeout: float,
                server: Server) -> str:
    """``_client_server``, once more on a fresh port when the two could not set up their
    socket handshake ("failed to setup RTE transport"): seen rarely on a busy machine, and
    unrelated to UCX's transports, so it says nothing about the baseline."""
    deadline = time.monotonic() + timeout
    try:
        return _client_server(binary, args, env, timeout, server)
    except RuntimeError as error:
        if "RTE" not in str(error) or deadline - time.monotonic() <= 1:
            raise
    return _client_server(binary, args, env, deadline - time.monotonic(), server)


def _client_server(binary: str, args: list[str], env: dict[str, str], timeout: float,
                   server: Server) -> str:
    """Runs ``server`` and a client connected to it; returns the client's stdout.

    Raises:
        RuntimeError: either side failed (with UCX's last error line) or passed ``timeout``.
    """
    deadline = time.monotonic() + timeout
    host, port = server.start()
    try:
        client = _client(binary, [host, "-p", str(port), *args], env, deadline)
        server_code, server_text = server.finish(_SERVER_EXIT_SECONDS)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ucx_perftest {' '.join(args)} did not finish within "
                           f"{timeout:g} s") from None
    finally:
        server.kill()
    if client.returncode != 0 or server_code != 0:
        raise RuntimeError(f"ucx_perftest {' '.join(args)} failed: client exit "
                           f"{client.returncode} ({_last_error(client.stderr + client.stdout)}), "
                           f"server exit {server_code} ({_last_error(server_text)})")
    return client.stdout


def _client(binary: str, argv: list[str], env: dict[str, str],
            deadline: float) -> subprocess.CompletedProcess[str]:
    """The client, retried while the server is not listening yet (for ``_CONNECT_SECONDS``)."""
    retry_until = min(deadline, time.monotonic() + _CONNECT_SECONDS)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(binary, 0)
        client = subprocess.run([binary, *argv], env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=remaining)
        refused = "Connection refused" in client.stderr + client.stdout
        if not refused or time.monotonic() > retry_until:
            return client
        time.sleep(0.05)


def _last_error(text: str) -> str:
    """UCX's last ``ERROR`` line without its timestamp prefix, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line.split("ERROR", 1)[1].strip() for line in lines if "ERROR" in line]
    return (errors or lines or ["no output"])[-1]


def parse_output(text: str) -> dict[str, float]:
    """The final result row of ``ucx_perftest`` output, by column name.

    Accepts the CSV format (``-v``: a header line starting ``iterations,`` then rows) and the
    table format (a row of 8 numbers, maybe labelled ``Final:``); the last row wins.

    Raises:
        ValueError: no result row in ``text``.
    """
    columns = list(_COLUMNS)
    result: dict[str, float] | None = None
    for line in text.splitlines():
        cells = line.replace(",", " ").replace("|", " ").split()
        if cells and cells[0] == "iterations":
            columns = cells
            continue
        if cells and cells[0].endswith(":"):  # "Final:" label of the table format
            cells = cells[1:]
        numbers = _floats(cells)
        if numbers is not None and len(numbers) == len(columns):
            result = dict(zip(columns, numbers))
    if result is None or not {"iterations", "overall_bw"} <= result.keys():
        tail = " | ".join(text.strip().splitlines()[-3:]) or "no output"
        raise ValueError(f"no result row in ucx_perftest output: {tail}")
    return result


def _floats(cells: list[str]) -> list[float] | None:
    try:
        return [float(cell) for cell in cells]
    except ValueError:
        return None
