"""``kvmove-bench transfer`` (``kvmove/bench/transfer.py``, ``kvmove/bench/peer.py``) and the
``ucx_perftest`` baseline (``kvmove/bench/perftest.py``).

The CLI runs as a real process from a scratch directory, with tiny settings so each run takes
seconds: Llama-3.2-1B (16 layers, 8 KV heads, head_dim 64, float16: 2,048 B per token per
layer), 64 tokens in blocks of 16, i.e. 4 blocks of 32 KiB per layer, 2,097,152 B in all.
Numbers are never asserted (benchmarks are tools, not tests); what is asserted is that every
row exists, every byte was verified, and bad input or a failing peer ends the run clearly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvmove
from kvmove import _C
from kvmove.bench import engine_caches, perftest
from kvmove.bench.against_report import NixlRoundTrip, NixlRow, NixlRun
from kvmove.bench.mooncake_report import MooncakeRow, MooncakeRun
from kvmove.bench.peer import Peer, Side
from kvmove.bench.report import BenchError
from kvmove.bench.store import StoreBenchConfig, StoreReport, TtftRow, format_store
from kvmove.bench.transfer_report import (
    BenchConfig,
    BenchReport,
    RoundTrip,
    TransferRow,
)
from kvmove.bench.transfer_text import format_transfer
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec

TINY = ["--model", "llama-3.2-1b", "--tokens", "64", "--iters", "1"]
TINY_BYTES = 16 * 4 * 16 * 2048  # layers * blocks * tokens per block * bytes per token-layer
TINY_OPS_ALLOCATOR = 16  # one contiguous run per layer
TINY_OPS_SCATTER = 64  # no two blocks adjacent on both sides: one op per (layer, block)
RUN_SECONDS = 180  # a hung run fails the test instead of hanging it

Bench = Callable[..., subprocess.CompletedProcess[str]]


def _commands() -> list[list[str]]:
    """The installed ``kvmove-bench`` script when there is one, and ``python -m``."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    script = shutil.which("kvmove-bench", path=search)
    return [[script]] * bool(script) + [[sys.executable, "-m", "kvmove.bench.cli"]]


COMMANDS = _commands()


def _runner(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> Bench:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd,
                              timeout=RUN_SECONDS, env=env)
    return run


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    """The first of ``COMMANDS``, in a scratch directory (only the installed package imports)."""
    return _runner(COMMANDS[0], tmp_path)


@pytest.fixture(params=COMMANDS, ids=lambda command: os.path.basename(command[-1]))
def each_bench(request: pytest.FixtureRequest, tmp_path: Path) -> Bench:
    return _runner(request.param, tmp_path)


def _json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # stdout holds the JSON and nothing else


# --- output ---------------------------------------------------------------------------------

def test_text_has_one_row_per_configuration(bench: Bench) -> None:
    result = bench("transfer", *TINY, "--scatter", "--transports", "tcp", "--same-host", "ucx")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for op in ("write", "read"):
        for placement in ("allocator", "scatter"):
            line = next(line for line in out.splitlines()
                        if line.split()[:2] == [op, placement])
            assert "2,097,152" in line and line.rstrip().endswith("yes"), line
    for text in ("ops posted", "post ms", "total ms", "GB/s", "% of memcpy", "% of limit",
                 "% of perftest", "memcpy (numpy copyto, one thread)",
                 "copy limit (kvmove's copy kernel, ", "ucx_perftest ucp_put_bw",
                 "ucx_perftest ucp_get", "ucx_perftest ucp_put_lat", "round trip", "NVLink",
                 "InfiniBand 400G", "Ethernet 25G", "this machine, write (allocator)",
                 "bytes and notifications over transports tcp (tcp/lo)",
                 f"UCX {kvmove.ucx_version()} from the "):
        assert text in out, text
    assert "Traceback" not in result.stderr


def test_json_reports_verified_rows_and_baselines(bench: Bench) -> None:
    data = _json(bench("transfer", *TINY, "--scatter", "--json"))
    assert data["verified"] is True
    assert {"config", "layout", "kv_bytes", "rows", "baselines", "round_trip", "links",
            "wall_seconds"} <= data.keys()
    assert data["kv_bytes"] == TINY_BYTES and data["against"] == []
    # the default, error mode peer, on one host: shared memory and cma (docs/transfer.md)
    assert "cma/memory" in data["transports_used"]
    assert not [tl for tl in data["transports_used"] if tl.startswith("tcp/")]
    # and the bytes themselves go through the peer's mapped memory (same_host="map")
    assert data["path"] == "mapped"
    # which UCX, and what it offers here (why a run used tcp and not RDMA)
    assert data["ucx"]["version"] == kvmove.ucx_version()
    assert "tcp/lo" in data["ucx"]["transports"] and isinstance(data["ucx"]["rdma"], bool)
    rows = {(row["op"], row["placement"]): row for row in data["rows"]}
    assert set(rows) == {(op, p) for op in ("write", "read") for p in ("allocator", "scatter")}
    for (op, placement), row in rows.items():
        assert row["verified"] is True and row["mismatched_blocks"] == 0
        assert row["nbytes"] == TINY_BYTES and row["num_blocks"] == 4
        assert row["num_ops"] == (TINY_OPS_ALLOCATOR if placement == "allocator"
                                  else TINY_OPS_SCATTER)
        assert len(row["iter_seconds"]) == 1
        for key in ("post_seconds", "total_seconds", "gbytes_per_s", "memcpy_pct",
                    "copy_limit_pct", "post_share_pct"):
            assert row[key] > 0, key
        assert row["perftest_test"] == {"write": "ucp_put_bw", "read": "ucp_get"}[op]
        assert row["nixl_gbytes_per_s"] is row["nixl_ratio"] is None  # no --against
    baselines = data["baselines"]
    assert [m["nbytes"] for m in baselines["memcpy"]] == [TINY_BYTES]
    # the machine's own copy limit: kvmove's copy kernel and thread count, one process
    (limit,) = baselines["copy_limit"]
    assert limit["nbytes"] == TINY_BYTES and limit["threads"] == kvmove._C.default_copy_threads()
    assert limit["gbytes_per_s"] > 0
    sizes = {(p["test"], p["message_nbytes"]) for p in baselines["perftest_bw"]}
    assert {(row["perftest_test"], row["op_nbytes"]) for row in rows.values()} <= sizes
    assert [p["message_nbytes"] for p in baselines["perftest_put_lat"]] == [8, 32768]
    assert data["round_trip"]["nbytes"] == 32768 and data["round_trip"]["one_way_us"] > 0
    assert [link["name"] for link in data["links"]][:3] == ["NVLink", "InfiniBand 400G",
                                                            "Ethernet 25G"]


def test_default_command_is_transfer(each_bench: Bench) -> None:
    data = _json(each_bench(*TINY, "--error-mode", "none", "--json"))
    assert data["config"]["error_mode"] == "none"
    assert [(row["op"], row["placement"]) for row in data["rows"]] == [
        ("write", "allocator"), ("read", "allocator")]
    assert data["verified"] is True


def test_plan_still_runs(bench: Bench) -> None:
    assert _json(bench("plan", "--json"))["kv_bytes"] == 524_288_000


# --- --sweep and --plot ---------------------------------------------------------------------

def test_sweep_plots_every_block_size(bench: Bench, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bw.png"
    result = bench("transfer", *TINY, "--sweep", "--json", "--plot", str(png))
    data = _json(result)
    assert sorted({row["block_size"] for row in data["rows"]}) == [16, 32, 64, 128]
    assert all(row["verified"] for row in data["rows"])
    put_sizes = {p["message_nbytes"] for p in data["baselines"]["perftest_bw"]
                 if p["test"] == "ucp_put_bw"}
    assert {4096, 65536, 1 << 20, 16 << 20} <= put_sizes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kvmove-bench transfer:" not in result.stderr  # --json to a pipe: no bar


def _without(tmp_path: Path, *modules: str) -> Bench:
    """The CLI with each of ``modules`` failing to import, as if it were not installed (its
    spawned processes too: they inherit ``sys.path``)."""
    hidden = tmp_path / "hidden"
    for module in modules:
        fake = hidden / module
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text(
            f"raise ModuleNotFoundError('{module} hidden by the test')\n")
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    return _runner(COMMANDS[0], tmp_path, {**os.environ, "PYTHONPATH": path})


def test_plot_without_matplotlib_exits_2(tmp_path: Path) -> None:
    result = _without(tmp_path, "matplotlib")("transfer", *TINY, "--plot", "x.png")
    assert result.returncode == 2
    assert "pip install kvmove[bench]" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()


# --- --against nixl -------------------------------------------------------------------------

@functools.cache
def _nixl_missing() -> str:
    """Why NIXL does not import here ('' when it does), asked of a fresh interpreter so that
    this process never loads NIXL's UCX beside kvmove's."""
    probe = ("from kvmove.bench.nixl_side import import_nixl_api\n"
             "try:\n    import_nixl_api()\nexcept ImportError as e:\n    print(e)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=RUN_SECONDS, env=env)
    return result.stdout.strip() or result.stderr.strip()[-300:]


def test_against_nixl_reports_nixl_rows_and_ratios(bench: Bench) -> None:
    if _nixl_missing():
        pytest.skip(f"NIXL does not import here ({_nixl_missing()}): "
                    "pip install --no-deps nixl-cu13")
    data = _json(bench("transfer", *TINY, "--scatter", "--against", "nixl", "--json"))
    assert data["verified"] is True and data["config"]["against"] == ["nixl"]
    (against,) = data["against"]
    assert against["library"] == "nixl" and against["verified"] is True
    assert against["version"].startswith("nixl")
    # both ways of preparing NIXL's descriptor lists (NIXL 1.5.1 has strided lists)
    assert against["apis"] == ["per-block", "strided"] and against["skipped"] is None
    nixl = {(row["api"], row["op"], row["placement"]): row for row in against["rows"]}
    assert set(nixl) == {(api, op, p) for api in ("per-block", "strided")
                         for op in ("write", "read") for p in ("allocator", "scatter")}
    for row in data["rows"]:
        twins = [nixl[api, row["op"], row["placement"]] for api in ("per-block", "strided")]
        for twin in twins:
            assert twin["verified"] is True and twin["mismatched_blocks"] == 0
            assert (twin["nbytes"], twin["num_blocks"]) == (row["nbytes"], row["num_blocks"])
            # NIXL merges what kvmove coalesces: the same operations on the wire
            assert twin["num_descs"] == row["num_ops"]
            assert twin["prep_seconds"] > 0
        # kvmove against the better of NIXL's two ways
        assert row["nixl_gbytes_per_s"] == max(t["gbytes_per_s"] for t in twins) > 0
        assert math.isfinite(row["nixl_ratio"]) and row["nixl_ratio"] > 0
    assert against["round_trip"]["nbytes"] == data["round_trip"]["nbytes"]
    assert math.isfinite(against["round_trip_time_ratio"])
    assert against["round_trip_time_ratio"] > 0


def test_against_nixl_without_nixl_exits_2_saying_how_to_get_it(tmp_path: Path) -> None:
    start = time.monotonic()
    result = _without(tmp_path, "nixl", "nixl_cu13", "nixl_cu12")(
        "transfer", *TINY, "--against", "nixl")
    assert result.returncode == 2, result.stderr
    assert "--against nixl needs NIXL's Python package" in result.stderr
    assert "hidden by the test" in result.stderr  # the import's own reason
    assert "pip install --no-deps nixl-cu13" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert time.monotonic() - start < RUN_SECONDS / 2  # before measuring, not after


def test_text_puts_kvmove_and_nixl_side_by_side() -> None:
    config = BenchConfig(model="llama-3.2-1b", num_tokens=64, against=("nixl",))
    kvmove_row = TransferRow("write", "allocator", 16, 2_000_000, 4, 16, 0.0001, 0.001,
                             0.0009, (0.001,), 0.002, 0)
    nixl_row = NixlRow("write", "allocator", 16, 2_000_000, 4, 16, 0.0001, 0.0001, 0.004,
                       (0.004,), 0.005, 0)
    perf = perftest.PerftestResult("ucp_put_bw", kvmove_row.op_nbytes, None, True, False,
                                   reason="not run")
    report = BenchReport(config, (kvmove_row,), RoundTrip(32768, 200, 100.0),
                         {2_000_000: 10.0}, (perf,), (), 1.0,
                         nixl=NixlRun("nixl-cu13 1.5.1", (nixl_row,),
                                      NixlRoundTrip(32768, 200, 40.0)))
    text = format_transfer(report)
    line = next(line for line in text.splitlines() if line.startswith("write  allocator")
                and "0.50" in line)
    assert line.split()[-3:] == ["-", "4.00", "yes"]  # no strided row; 2.00 GB/s over 0.50
    assert "against nixl-cu13 1.5.1" in text
    assert "kvmove 50.0 us, NIXL 20.0 us" in text and "kvmove / NIXL time 2.50" in text
    assert report.to_dict()["rows"][0]["nixl_ratio"] == pytest.approx(4.0)
    # with NIXL's strided lists faster (1.00 GB/s), kvmove is compared with those
    strided = dataclasses.replace(nixl_row, total_seconds=0.002, api="strided",
                                  prep_seconds=0.0005)
    both = dataclasses.replace(report, nixl=dataclasses.replace(
        report.nixl, rows=(dataclasses.replace(nixl_row, prep_seconds=0.05), strided)))
    text = format_transfer(both)
    line = next(line for line in text.splitlines() if line.startswith("write  allocator")
                and "0.50" in line)
    assert line.split()[-4:] == ["0.50", "1.00", "2.00", "yes"]
    assert "per-block 50.0 ms, strided 0.5 ms" in " ".join(text.split())
    assert both.to_dict()["rows"][0]["nixl_ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("against", [("lmcache",), "nixl", ("nixl", "nixl")])
def test_config_rejects_unknown_against(against: Any) -> None:
    with pytest.raises(ConfigError, match="against must be a tuple of distinct names of "
                       "\\('nixl', 'mooncake'\\), got"):
        BenchConfig(against=against)


# --- --against mooncake ---------------------------------------------------------------------

@functools.cache
def _mooncake_missing() -> str:
    """Why Mooncake's engine does not import here ('' when it does), asked of a fresh
    interpreter as for NIXL: this process never loads Mooncake's libraries beside kvmove's."""
    probe = ("from kvmove.bench.mooncake_side import import_mooncake_engine\n"
             "try:\n    import_mooncake_engine()\nexcept ImportError as e:\n    print(e)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=RUN_SECONDS, env=env)
    return result.stdout.strip() or result.stderr.strip()[-300:]


def test_against_mooncake_reports_mooncake_rows_and_ratios(bench: Bench) -> None:
    if _mooncake_missing():
        pytest.skip(f"Mooncake does not import here ({_mooncake_missing()}): "
                    "apt-get install libibverbs1 && pip install --no-deps "
                    "mooncake-transfer-engine-non-cuda")
    data = _json(bench("transfer", *TINY, "--scatter", "--against", "mooncake", "--json"))
    assert data["verified"] is True and data["config"]["against"] == ["mooncake"]
    (against,) = data["against"]
    assert against["library"] == "mooncake" and against["verified"] is True
    assert against["version"].startswith("mooncake")
    assert "batch_transfer_sync" in against["method"]
    assert against["settings"]["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"]
    mooncake = {(row["op"], row["placement"]): row for row in against["rows"]}
    assert set(mooncake) == {(op, p) for op in ("write", "read")
                             for p in ("allocator", "scatter")}
    for row in data["rows"]:
        twin = mooncake[row["op"], row["placement"]]
        assert twin["verified"] is True and twin["mismatched_blocks"] == 0
        assert (twin["nbytes"], twin["num_blocks"]) == (row["nbytes"], row["num_blocks"])
        # the ranges merged as kvmove coalesces runs: the same count
        assert twin["num_ranges"] == row["num_ops"]
        assert len(twin["iter_seconds"]) == 1  # --iters 1, after a warm-up
        assert row["mooncake_gbytes_per_s"] == twin["gbytes_per_s"] > 0
        assert math.isfinite(row["mooncake_ratio"]) and row["mooncake_ratio"] > 0
        assert row["nixl_gbytes_per_s"] is row["nixl_ratio"] is None
    assert against["round_trip"]["nbytes"] == data["round_trip"]["nbytes"]
    assert against["round_trip"]["iterations"] == data["round_trip"]["iterations"]
    assert math.isfinite(against["round_trip_time_ratio"])
    assert against["round_trip_time_ratio"] > 0


def test_against_mooncake_text_has_its_table(bench: Bench) -> None:
    if _mooncake_missing():
        pytest.skip(f"Mooncake does not import here ({_mooncake_missing()})")
    result = bench("transfer", *TINY, "--against", "mooncake")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "against mooncake-transfer-engine" in out
    for op in ("write", "read"):
        lines = [line for line in out.splitlines() if line.split()[:2] == [op, "allocator"]]
        assert len(lines) == 2, lines  # kvmove's row, and the comparison's
        assert lines[1].rstrip().endswith("yes")
    assert "Mooncake ranges" in out and "kvmove / Mooncake" in out
    assert "Traceback" not in result.stderr


def test_against_mooncake_without_mooncake_exits_2_saying_how_to_get_it(
        tmp_path: Path) -> None:
    start = time.monotonic()
    result = _without(tmp_path, "mooncake")("transfer", *TINY, "--against", "mooncake")
    assert result.returncode == 2, result.stderr
    assert "--against mooncake needs Mooncake's transfer engine" in result.stderr
    assert "hidden by the test" in result.stderr  # the import's own reason
    assert ("apt-get install libibverbs1 && pip install --no-deps "
            "mooncake-transfer-engine-non-cuda") in result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert time.monotonic() - start < RUN_SECONDS / 2  # before measuring, not after


def test_text_puts_kvmove_and_mooncake_side_by_side() -> None:
    config = BenchConfig(model="llama-3.2-1b", num_tokens=64, against=("mooncake",))
    kvmove_row = TransferRow("write", "allocator", 16, 2_000_000, 4, 16, 0.0001, 0.001,
                             0.0009, (0.001,), 0.002, 0)
    mooncake_row = MooncakeRow("write", "allocator", 16, 2_000_000, 4, 16, 0.0001, 0.004,
                               (0.004,), 0.005, 0)
    perf = perftest.PerftestResult("ucp_put_bw", kvmove_row.op_nbytes, None, True, False,
                                   reason="not run")
    run = MooncakeRun("mooncake-transfer-engine-non-cuda 0.3.13.post1", (mooncake_row,),
                      RoundTrip(32768, 200, 400.0),
                      {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535"})
    report = BenchReport(config, (kvmove_row,), RoundTrip(32768, 200, 100.0),
                         {2_000_000: 10.0}, (perf,), (), 1.0, mooncake=run)
    text = format_transfer(report)
    line = next(line for line in text.splitlines() if line.startswith("write  allocator")
                and "0.50" in line)
    assert line.split()[-4:] == ["16", "0.50", "4.00", "yes"]  # 2.00 GB/s over 0.50
    assert "against mooncake-transfer-engine-non-cuda 0.3.13.post1" in text
    assert "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=65535" in " ".join(text.split())
    assert "kvmove 50.0 us, Mooncake 200.0 us" in " ".join(text.split())
    assert "kvmove / Mooncake time 0.25" in " ".join(text.split())
    data = report.to_dict()
    assert data["rows"][0]["mooncake_ratio"] == pytest.approx(4.0)
    assert data["rows"][0]["nixl_ratio"] is None
    assert [run["library"] for run in data["against"]] == ["mooncake"]
    assert data["against"][0]["round_trip_time_ratio"] == pytest.approx(0.25)
    # a row Mooncake got wrong makes the whole report unverified
    bad = dataclasses.replace(report, mooncake=dataclasses.replace(
        run, rows=(dataclasses.replace(mooncake_row, mismatched_blocks=3),)))
    assert bad.verified is False and "NO" in format_transfer(bad).split()


def test_against_both_libraries_in_one_run(bench: Bench) -> None:
    """``--against nixl --against mooncake``: one report, kvmove's rows against both."""
    missing = _nixl_missing() or _mooncake_missing()
    if missing:
        pytest.skip(f"NIXL or Mooncake does not import here ({missing})")
    result = bench("transfer", *TINY, "--against", "nixl", "--against", "mooncake")
    assert result.returncode == 0, result.stderr
    assert "against nixl" in result.stdout and "against mooncake" in result.stdout
    data = _json(bench("transfer", *TINY, "--against", "mooncake", "--against", "nixl",
                       "--json"))
    assert data["verified"] is True and data["config"]["against"] == ["mooncake", "nixl"]
    assert [run["library"] for run in data["against"]] == ["nixl", "mooncake"]
    assert all(run["verified"] for run in data["against"])
    for row in data["rows"]:
        assert row["nixl_ratio"] > 0 and row["mooncake_ratio"] > 0


# --- stream ---------------------------------------------------------------------------------

STREAM_TINY = ["--model", "llama-3.2-1b", "--tokens", "64", "--iters", "2"]


def test_stream_json_reports_every_layer_and_the_hidden_fraction(bench: Bench) -> None:
    report = _json(bench("stream", *STREAM_TINY, "--compute-ms", "1", "--json"))
    assert report["verified"] is True
    assert report["num_layers"] == 16 and report["nbytes"] == TINY_BYTES
    assert report["compute_ms_per_layer"] == 1.0
    assert len(report["iterations"]) == 2
    for it in report["iterations"]:
        assert it["mismatched_blocks"] == 0
        assert len(it["compute"]) == len(it["transfer"]) == len(it["arrived"]) == 16
        for (start, end), (posted, landed), arrived in zip(it["compute"], it["transfer"],
                                                           it["arrived"]):
            # a layer is posted after its compute, and both sides see it in after that (one
            # host, one monotonic clock; which side sees it first is a race)
            assert start <= end <= posted <= min(landed, arrived)
        assert it["stream_exposed_seconds"] >= 0 and it["bulk_transfer_seconds"] > 0
        assert it["hidden_fraction"] == 1 - it["stream_exposed_seconds"] / \
            it["bulk_transfer_seconds"]
    assert report["save_layer_us_mean"] > 0
    assert report["hidden_fraction"] in [it["hidden_fraction"] for it in report["iterations"]]


def test_stream_text(bench: Bench) -> None:
    result = bench("stream", *STREAM_TINY)
    assert result.returncode == 0, result.stderr
    for text in ("hidden fraction:", "prefill compute ms", "save_layer() call", "16 layers"):
        assert text in result.stdout


def test_stream_plot(bench: Bench, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the [bench] extra
    result = bench("stream", *STREAM_TINY, "--plot", "timeline.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "value"), [
    (["--compute-ratio", "0"], "got 0"), (["--compute-ms", "-1"], "-1"),
    (["--compute-ratio", "inf"], "inf"), (["--iters", "0"], "got 0"),
    (["--error-mode", "often"], "often"),
])
def test_stream_bad_option_exits_2(bench: Bench, args: list[str], value: str) -> None:
    result = bench("stream", *args)
    assert result.returncode == 2, result.stderr
    assert value in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


# --- engine ---------------------------------------------------------------------------------

ENGINE_TINY = ["--model", "tiny", "--prompt-tokens", "64", "--context-tokens", "32",
               "--decode-batch-sizes", "1", "2", "--iters", "1"]


def test_engine_json_has_prefill_and_decode_against_batch_1(bench: Bench) -> None:
    report = _json(bench("engine", *ENGINE_TINY, "--json"))
    assert report["prefill"]["num_tokens"] == 64 and report["prefill"]["tokens_per_s"] > 0
    assert [row["batch_size"] for row in report["decode"]] == [1, 2]
    first, second = report["decode"]
    assert first["tokens_per_s_vs_batch_1"] == 1.0
    assert second["tokens_per_s_vs_batch_1"] == second["tokens_per_s"] / first["tokens_per_s"]


def test_engine_text(bench: Bench) -> None:
    result = bench("engine", *ENGINE_TINY)
    assert result.returncode == 0, result.stderr
    assert "asymmetry:" in result.stdout and "tiny Llama" in result.stdout


@pytest.mark.parametrize(("args", "value"), [
    (["--model", "huge"], "huge"), (["--decode-batch-sizes", "0"], "got 0"),
    (["--prompt-tokens", "-3"], "-3"), (["--iters", "0"], "got 0"),
])
def test_engine_bad_option_exits_2(bench: Bench, args: list[str], value: str) -> None:
    result = bench("engine", *args)
    assert result.returncode == 2, result.stderr
    assert value in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


# --- store ----------------------------------------------------------------------------------

STORE_TINY = ["--model", "llama-3.2-1b", "--tokens", "64", "--iters", "1", "--engine-model",
              "tiny", "--prompt-tokens", "64"]


def test_store_json_has_every_tier_row_and_the_three_ttft_cases(bench: Bench,
                                                                tmp_path: Path) -> None:
    report = _json(bench("store", *STORE_TINY, "--dir", str(tmp_path), "--json"))
    assert report["nbytes"] == TINY_BYTES
    rows = [(r["tier"], r["op"]) for r in report["tiers"]]
    assert rows == [("host", "write"), ("host", "read"), ("disk", "write"), ("disk", "read")]
    for row in report["tiers"]:
        assert row["gbps"] > 0 and row["baseline_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["baseline_gbps"])
    cases = {r["case"]: r for r in report["ttft"]}
    assert list(cases) == ["recompute", "host hit", "disk hit"]
    assert cases["recompute"]["loaded_tokens"] == 0 and cases["recompute"]["decision"] is None
    for case in ("host hit", "disk hit"):  # (64 - 1) // 16 blocks: the last token is computed
        assert cases[case]["loaded_tokens"] == 48
        assert cases[case]["decision"] in ("load", "partial", "recompute")
        assert isinstance(cases[case]["picked_faster"], bool)
    assert os.listdir(tmp_path) == []  # its scratch directory is gone


def test_store_text_without_ttft(bench: Bench) -> None:
    result = bench("store", *STORE_TINY, "--no-ttft")
    assert result.returncode == 0, result.stderr
    assert "dd iflag=direct" in result.stdout and "memcpy" in result.stdout
    assert "time to first token" not in result.stdout


def test_store_text_shows_the_ttft_table_in_milliseconds() -> None:
    """The TTFT table of the text report (the default): each case's median and the store's
    estimates in ms, and whether its decision picked the faster way."""
    ttft = [TtftRow("recompute", (0.2,), 0), TtftRow("host hit", (0.05,), 48, "load", 0.01, 0.2),
            TtftRow("disk hit", (0.3,), 48, "load", 0.03, 0.2)]
    text = format_store(StoreReport(StoreBenchConfig(), TINY_BYTES, True, [], ttft))
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("recompute", "host hit", "disk hit"))}
    assert rows["recompute"][1] == "200.00"
    assert rows["host"][2:4] == ["50.00", "4.0x"] and rows["host"][-1] == "yes"
    assert rows["disk"][2] == "300.00" and "30.00" in rows["disk"] and rows["disk"][-1] == "NO"


@pytest.mark.parametrize(("args", "value"), [
    (["--engine-model", "huge"], "huge"), (["--iters", "0"], "got 0"),
    (["--dir", "/nonexistent-kvmove-dir"], "/nonexistent-kvmove-dir"),
    (["--prompt-tokens", "0"], "got 0"), (["--tokens", "8"], "got 8"),
])
def test_store_bad_option_exits_2(bench: Bench, args: list[str], value: str) -> None:
    result = bench("store", *STORE_TINY, *args)
    assert result.returncode == 2, result.stderr
    assert value in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


# --- bad input and failures -----------------------------------------------------------------

@pytest.mark.parametrize(
    ("args", "value"),
    [(["--tokens", "0"], "got 0"), (["--tokens", "-5"], "-5"), (["--block-size", "48"], "48"),
     (["--model", "llama-9"], "llama-9"), (["--iters", "0"], "got 0"),
     (["--error-mode", "sometimes"], "sometimes"), (["--timeout", "-1"], "-1"),
     (["--tokens", "many"], "many"), (["--transports", " "], "' '"),
     (["--timeout", "inf"], "inf"), (["--plot", "no/such/folder/x.png"], "no/such/folder"),
     (["--wrap", "bogus"], "bogus"), (["--against", "lmcache"], "lmcache")],
)
def test_bad_option_exits_2(each_bench: Bench, args: list[str], value: str) -> None:
    result = each_bench("transfer", *args)
    assert result.returncode == 2, result.stderr
    assert value in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_unknown_transport_fails_clearly(bench: Bench) -> None:
    result = bench("transfer", *TINY, "--transports", "no_such_tl")
    assert result.returncode == 1
    assert "no_such_tl" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("field", ["num_tokens", "iters", "spare_factor", "round_trips"])
def test_config_rejects_non_positive(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} .*got 0"):
        BenchConfig(**{field: 0})


def test_config_rejects_unknown_placement() -> None:
    with pytest.raises(ConfigError, match="'diagonal'"):
        BenchConfig(placements=("diagonal",))


def test_config_rejects_unknown_wrap_format() -> None:
    with pytest.raises(ConfigError, match="wrap must be one of .*'flash-attn'"):
        BenchConfig(wrap="flash-attn")


# --- verification catches every kind of wrong byte ------------------------------------------

@pytest.fixture
def side() -> Side:
    handle = Side("verify", KVSpec.preset("llama-3.2-1b"), 16, {"transports": "tcp"})
    yield handle
    handle.close()


def test_pattern_verification_finds_each_wrong_block(side: Side) -> None:
    ids = side.place(8, "scatter", seed=4)
    side.fill(ids, seed=9)
    assert side.mismatches(ids, ids, seed=9) == 0
    assert side.mismatches(ids, ids, seed=10) == 16 * 8  # another seed: every (layer, block)
    raw = np.asarray(side.cache.region).reshape(16, 16, -1)
    raw[3, ids[5], 1000] ^= 1  # one bit of one block in one layer
    assert side.mismatches(ids, ids, seed=9) == 1
    raw[7, [ids[0], ids[1]]] = raw[7, [ids[1], ids[0]]]  # two blocks swapped in one layer
    assert side.mismatches(ids, ids, seed=9) == 3
    side.wipe(ids)
    assert side.mismatches(ids, ids, seed=9) == 16 * 8


def test_placements(side: Side) -> None:
    assert side.place(8, "allocator", seed=0) == list(range(8))  # one run in a fresh pool
    scattered = side.place(8, "scatter", seed=0)
    assert len(set(scattered)) == 8 and scattered != sorted(scattered)
    assert side.cache.pool.num_free == 8  # the previous placement was given back


# --- --wrap: engines' own tensors beside the native cache ----------------------------------

# Ops per layer for 4 consecutive blocks: one per plane (K and V apart for flash and SGLang).
PLANES = {"flash": 2, "flashinfer": 1, "vllm-cpu": 1, "sglang": 2, "mla": 1}


@pytest.mark.parametrize("fmt", engine_caches.WRAP_FORMATS)
def test_wrap_json_has_native_and_wrapped_rows_of_one_run(bench: Bench, fmt: str) -> None:
    data = _json(bench("transfer", *TINY, "--wrap", fmt, "--json"))
    assert data["verified"] is True and data["config"]["wrap"] == fmt
    assert data["layout"]["mla"] is (fmt == "mla")
    assert data["kv_bytes"] == TINY_BYTES  # MLA too: one latent of the same bytes per token
    assert [(row["cache"], row["op"]) for row in data["rows"]] == [
        ("native", "write"), ("native", "read"), (fmt, "write"), (fmt, "read")]
    native = {row["op"]: row for row in data["rows"] if row["cache"] == "native"}
    for row in data["rows"]:
        assert row["verified"] is True and row["nbytes"] == TINY_BYTES
        if row["cache"] == "native":
            assert row["num_ops"] == TINY_OPS_ALLOCATOR and row["native_ratio"] is None
            continue
        assert row["num_ops"] == TINY_OPS_ALLOCATOR * PLANES[fmt]
        assert row["native_num_ops"] == TINY_OPS_ALLOCATOR
        assert row["native_ratio"] == pytest.approx(
            row["gbytes_per_s"] / native[row["op"]]["gbytes_per_s"])
    _check_registration(data, fmt)


def _check_registration(data: dict, fmt: str) -> None:
    """One entry per cache, over the near cache's bytes (twice the KV moved)."""
    entries = data["registration"]
    assert [r["cache"] for r in entries] == ["native", fmt]
    for entry in entries:
        assert entry["block_size"] == 16 and entry["nbytes"] == 2 * TINY_BYTES
        assert entry["agent_seconds"] > 0
        assert entry["seconds"] == pytest.approx(entry["wrap_seconds"] + entry["agent_seconds"])
        assert entry["seconds_per_gb"] == pytest.approx(entry["seconds"] / (2 * TINY_BYTES / 1e9))
    assert entries[0]["wrap_seconds"] == 0 and entries[1]["wrap_seconds"] > 0
    assert "KVCache.wrap" in data["registration_timed"]
    assert "ucp_mem_map" in data["registration_timed"]


def test_wrap_text_shows_the_cache_the_ratio_and_registration(bench: Bench) -> None:
    result = bench("transfer", *TINY, "--wrap", "sglang", "--scatter")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for op in ("write", "read"):
        for placement in ("allocator", "scatter"):
            for cache in ("native", "sglang"):
                line = next(line for line in lines if line.split()[:3] == [op, placement, cache])
                ratio = line.split()[11]
                assert (ratio == "-") if cache == "native" else (float(ratio) > 0), line
                assert line.rstrip().endswith("yes"), line
    for text in ("x native", "caches: native (KVCache), then sglang", "registration per GB",
                 "s/GB", "ucp_mem_map", "memcpy (numpy copyto, one thread)", "copy limit",
                 "ucx_perftest ucp_put_bw"):
        assert text in result.stdout, text
    assert [line.split()[0] for line in lines if line.split()[1:2] == ["16"]] == [
        "native", "sglang"]  # the registration rows


@pytest.mark.parametrize("fmt", engine_caches.ENGINES)
def test_block_words_are_the_bytes_kvmove_moves(fmt: str) -> None:
    """Each block's words, plane after plane, are the bytes of the cache's descriptors."""
    layout = engine_caches.layout_for_format(fmt, KVSpec(2, 2, 8, block_size=4))
    tensors = engine_caches.allocate(fmt, layout, 6)
    cache = engine_caches.wrap_engine(fmt, tensors, layout)
    words = engine_caches.block_words(fmt, tensors, 6)
    for planes in words:
        for plane in planes:
            plane[:] = np.random.default_rng(len(plane)).integers(0, 2**63, plane.shape)
    for layer in range(2):
        for block in (0, 3, 5):
            moved = b"".join(ctypes.string_at(addr, nbytes)
                             for addr, nbytes in cache.descriptors([block], layers=[layer]))
            mine = np.concatenate([plane[block] for plane in words[layer]]).tobytes()
            assert moved == mine, (layer, block)


def test_engine_caches_reject_what_they_cannot_allocate() -> None:
    with pytest.raises(ConfigError, match="'trtllm'"):
        engine_caches.allocate("trtllm", KVSpec(2, 2, 8), 4)
    with pytest.raises(ConfigError, match="numpy has no bfloat16.*torch"):
        engine_caches.allocate("flash", KVSpec(2, 2, 8, dtype="bfloat16"), 4)


def test_wrapped_side_verifies_each_plane() -> None:
    layout = KVSpec.preset("llama-3.2-1b")
    side = Side("verify", layout, 16, {"transports": "tcp"}, wrap="flash")
    try:
        assert side.cache.wrapped and side.cache.num_parts == 2
        assert side.registration.cache == "flash"
        assert side.registration.nbytes == 16 * layout.bytes_per_block
        ids = side.place(8, "scatter", seed=4)
        side.fill(ids, seed=9)
        assert side.mismatches(ids, ids, seed=9) == 0
        layer = side.cache.tensors[3]  # [2, N, B, H, D]: flip one bit of a V block
        layer[1, ids[5]].view(np.uint16).flat[100] ^= 1
        assert side.mismatches(ids, ids, seed=9) == 1
        side.wipe(ids)
        assert side.mismatches(ids, ids, seed=9) == 16 * 8
    finally:
        side.close()


# --- the peer process: errors and death surface, never hang ---------------------------------

@pytest.fixture
def peer() -> Peer:
    handle = Peer(timeout=20.0)
    yield handle
    handle.stop()


def test_peer_error_is_reported(peer: Peer) -> None:
    with pytest.raises(BenchError, match="'place'.*no setup yet"):
        peer.call("place", 4, "allocator", 0)


def test_dead_peer_is_reported(peer: Peer) -> None:
    peer.process.kill()
    peer.process.join(10)
    start = time.monotonic()
    with pytest.raises(BenchError, match="peer process (died|gone)"):
        peer.call("place", 4, "allocator", 0)
    assert time.monotonic() - start < 5


def _spawned_children(pid: int) -> list[int]:
    """Pids of ``multiprocessing`` spawn children of ``pid`` (Linux ``/proc``)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            children.append(int(entry.name))
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_cli_reports_a_killed_peer(tmp_path: Path) -> None:
    """SIGKILL the peer process of a running ``kvmove-bench transfer``: it must end soon with
    status 1 and a message, whichever step it was in."""
    args = ["transfer", "--model", "llama-3.2-1b", "--tokens", "4000", "--iters", "50",
            "--transports", "tcp"]
    process = subprocess.Popen([*COMMANDS[0], *args], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (children := _spawned_children(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, "no peer process"
            time.sleep(0.05)
        time.sleep(2.0)  # into the transfers
        os.kill(children[0], signal.SIGKILL)
        killed = time.monotonic()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, err
    assert time.monotonic() - killed < 30
    assert "kvmove-bench transfer: error:" in err and "Traceback" not in err
    assert out == ""


def test_silent_peer_times_out(peer: Peer) -> None:
    peer.timeout = 1.0
    os.kill(peer.process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(BenchError, match="did not answer 'place' within 1 s"):
            peer.call("place", 4, "allocator", 0)
        assert time.monotonic() - start < 5
    finally:
        os.kill(peer.process.pid, signal.SIGCONT)


# --- ucx_perftest ---------------------------------------------------------------------------

def test_perftest_parses_csv_and_table_formats() -> None:
    csv = ("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,"
           "overall_mr\n  32,0.030,21248.497,21248.497,735.35,735.35,47,47\n")
    assert perftest.parse_output(csv)["overall_bw"] == 735.35
    table = ("| Stage | # iterations | ... |\n"
             "Final:                    50      0.351  5857.720  5857.720     2667.42    "
             "2667.42         171         171\n")
    values = perftest.parse_output(table)
    assert values["overall_bw"] == 2667.42 and values["iterations"] == 50


@pytest.mark.parametrize("text", ["", "Waiting for connection...\n", "iterations,a,b\n1,2\n"])
def test_perftest_rejects_output_without_result(text: str) -> None:
    with pytest.raises(ValueError, match="no result row"):
        perftest.parse_output(text)


def test_perftest_bandwidth_and_latency_run() -> None:
    if perftest.find_binary() is None:
        pytest.skip("no ucx_perftest on this machine")
    bw = perftest.put_bandwidth(1 << 20, total_nbytes=1 << 24, transports="tcp")
    assert bw.available, bw.reason
    assert bw.gbytes_per_s > 0 and bw.iterations >= 16
    lat = perftest.put_latency(8, iterations=200, transports="tcp")
    assert lat.available, lat.reason
    assert lat.latency_us > 0


def test_baselines_run_with_the_agents_ucx_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """ucx_perftest (and NIXL's UCX) get the UCX settings every agent adds for tcp, and PEER
    mode's with -e, as environment variables; one the user set wins, as it does in an agent."""
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    tcp = {f"UCX_{key}": value for key, value in _C.tcp_settings()}
    assert {"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} <= set(tcp)
    assert perftest.agent_ucx_env(peer_errors=False) == tcp
    env = perftest.environment("ucx_perftest", "tcp", error_handling=True)
    assert env["UCX_TCP_TX_SEG_SIZE"] == tcp["UCX_TCP_TX_SEG_SIZE"]
    assert env["UCX_RNDV_THRESH"] == "inf"
    assert "UCX_RNDV_THRESH" not in perftest.environment("ucx_perftest", "tcp", False)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64K")
    assert "UCX_TCP_TX_SEG_SIZE" not in perftest.agent_ucx_env(peer_errors=True)
    assert perftest.environment("ucx_perftest", "tcp", True)["UCX_TCP_TX_SEG_SIZE"] == "64K"


def test_perftest_unavailable_says_why() -> None:
    if perftest.find_binary() is None:
        pytest.skip("no ucx_perftest on this machine")
    result = perftest.put_bandwidth(65536, total_nbytes=1 << 20, transports="no_such_tl")
    assert not result.available
    assert result.gbytes_per_s is None
    assert "failed" in result.reason and result.reason.strip()


def test_memory_cuda_without_a_device_exits_2_naming_why(bench: Bench) -> None:
    """Device memory on both sides needs a CUDA build and device; without one the bench stops
    before anything runs (bench/gpu_check.sh runs it where there is a GPU)."""
    status = kvmove.cuda_status()
    if status.device_count:
        pytest.skip("a CUDA device is here: bench/gpu_check.sh runs --memory cuda")
    result = bench("transfer", *TINY, "--memory", "cuda")
    assert result.returncode == 2, result.stderr
    assert "memory 'cuda' needs a usable CUDA device here" in result.stderr
    assert status.reason in result.stderr
    result = bench("transfer", *TINY, "--memory", "cuda", "--wrap", "flash")
    assert result.returncode == 2 and "native caches only" in result.stderr
