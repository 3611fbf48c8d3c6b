"""The core's log in Python's ``logging`` (``kvmove/_log.py``, ``csrc/common/log.h``).

Each case is a child process, so that ``KVMOVE_LOG_LEVEL`` is read at import as a user sets
it. The record is one the C++ core makes: UCX's own warning for a transport name it does not
know ("transport 'bogus' is not available"), which kvmove's UCX log handler
(``csrc/transport/ucx.cpp``) queues for logger "kvmove.ucx". (A malformed stream message would
do as well, but nothing in Python can send one.) The child prints every record that reaches
the root logger; its exit drains the core's queue, so an absent record is absent for good,
with no waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvmove.bench.cli import main

from helpers.checks import WORKDIR

CHILD = textwrap.dedent("""
    import logging, sys
    import kvmove

    class Show(logging.Handler):
        def emit(self, record):
            print(record.name, record.levelname, record.getMessage(), flush=True)

    logging.getLogger().addHandler(Show())
    if len(sys.argv) > 1:  # the application's own logging configuration, after import
        logging.getLogger("kvmove").setLevel(sys.argv[1])
    cache = kvmove.KVCache(kvmove.KVSpec.preset("llama-3.2-1b"), num_blocks=2)
    kvmove.Agent("a", cache, transports="tcp,bogus").close()
""")
BOGUS = "transport 'bogus' is not available"


def _child(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVMOVE_LOG", "UCX_LOG"))}
    return subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          cwd=WORKDIR, timeout=120, env={**environ, **env})


def _records(result: subprocess.CompletedProcess[str]) -> list[tuple[str, str, str]]:
    assert result.returncode == 0, result.stderr
    return [tuple(line.split(" ", 2)) for line in result.stdout.splitlines()]  # type: ignore


def test_a_core_record_reaches_logging_under_its_logger() -> None:
    records = _records(_child())
    ucx = [r for r in records if BOGUS in r[2]]
    assert [(name, level) for name, level, _ in ucx] == [("kvmove.ucx", "WARNING")], records


def test_kvmove_log_level_error_silences_the_warning() -> None:
    assert not [r for r in _records(_child(KVMOVE_LOG_LEVEL="error")) if BOGUS in r[2]]


def test_the_kvmove_logger_level_governs_the_core_too() -> None:
    assert not [r for r in _records(_child("ERROR")) if BOGUS in r[2]]


def test_debug_lets_ucx_chatter_through_at_debug() -> None:
    """UCX's info messages (here: its version line) map to debug, so they appear only when
    KVMOVE_LOG_LEVEL asks for debug, whatever UCX_LOG_LEVEL lets out of UCX."""
    debug = _records(_child(KVMOVE_LOG_LEVEL="debug", UCX_LOG_LEVEL="info"))
    info = _records(_child(KVMOVE_LOG_LEVEL="info", UCX_LOG_LEVEL="info"))
    assert any(n == "kvmove.ucx" and lvl == "DEBUG" and "Version" in m for n, lvl, m in debug)
    assert not [r for r in info if r[1] == "DEBUG"]
    assert any(BOGUS in m for _, _, m in info)


def test_a_bad_kvmove_log_level_fails_the_import_naming_it() -> None:
    result = _child(KVMOVE_LOG_LEVEL="loud")
    assert result.returncode != 0
    assert "log level must be one of ['debug', 'error', 'info', 'warning'], got 'loud'" \
        in result.stderr


def test_processes_exit_cleanly_with_the_log_thread_running() -> None:
    """The pump used to block inside the core; a process finalizing meanwhile aborted
    (std::terminate, status 134) in 3 of 4 such runs. Ten in a row must exit 0."""
    for _ in range(10):
        result = subprocess.run([sys.executable, "-c", "import time, kvmove; time.sleep(0.2)"],
                                capture_output=True, text=True, cwd=WORKDIR, timeout=60)
        assert (result.returncode, result.stderr) == (0, "")


# --- kvmove-bench --log-level ----------------------------------------------------------------

STREAM_BOGUS = ["stream", "--model", "llama-3.2-1b", "--tokens", "64", "--iters", "1",
                "--transports", "tcp,bogus", "--json"]


@pytest.mark.parametrize(("where", "level", "shown"),
                         [("before", "warning", True), ("after", "error", False)])
def test_bench_log_level_option(where: str, level: str, shown: bool) -> None:
    """--log-level (before or after the subcommand) sets what reaches stderr, formatted with
    the logger's name, in the CLI and in the peer process it starts (which would log the same
    warning: the environment says debug); stdout keeps the JSON report alone."""
    args = (["--log-level", level, *STREAM_BOGUS] if where == "before"
            else [*STREAM_BOGUS, "--log-level", level])
    result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", *args],
                            capture_output=True, text=True, cwd=WORKDIR, timeout=180,
                            env={**os.environ, "KVMOVE_LOG_LEVEL": "debug"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.lstrip().startswith("{")
    assert ("WARNING kvmove.ucx: ucp_context.c" in result.stderr) is shown, result.stderr
    assert (BOGUS in result.stderr) is shown


def test_bench_version(capsys: pytest.CaptureFixture[str]) -> None:
    import kvmove

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvmove-bench {kvmove.__version__}\n"


def test_bench_rejects_a_bad_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--log-level", "loud", "plan"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--log-level", "info", "--tokens", "64"], ["--log-level", "info", "transfer", "--tokens",
                                                 "64"]),
    (["--log-level=info"], ["--log-level=info", "transfer"]),
    (["--log-level", "info", "plan"], ["--log-level", "info", "plan"]),
    (["--version"], ["--version"]),
])
def test_bench_log_level_before_the_default_command(argv: list[str],
                                                    expected: list[str]) -> None:
    from kvmove.bench.cli import _with_default_command

    assert _with_default_command(argv) == expected
