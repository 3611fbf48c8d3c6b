"""``kvmove-bench classes`` as a user runs it: every mode measured the asked number of times,
the offload's bytes counted, the path named, bad values refused with exit 2 naming the flag.
What the figures are is the benchmark's business (no thresholds here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.checks import WORKDIR

SMALL = ("--handoff-blocks", "1", "--offload-ratio", "10", "--iters", "2")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "classes", *args],
                          capture_output=True, text=True, timeout=180, cwd=WORKDIR)


def test_json_has_each_mode_measured_and_compared_with_idle() -> None:
    run = bench(*SMALL, "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["path"] == "mapped"
    assert report["handoff_bytes"] == 2 << 20 and report["offload_write_bytes"] == 20 << 20
    rows = {row["mode"]: row for row in report["rows"]}
    assert list(rows) == ["idle", "one class", "classes"]
    for row in rows.values():
        assert len(row["latencies"]) == 2 * 3 and min(row["latencies"]) > 0
        assert row["vs_idle"] == pytest.approx(row["median_seconds"]
                                               / rows["idle"]["median_seconds"])
    assert rows["idle"]["offload_bytes"] == 0
    for mode in ("one class", "classes"):  # whole writes of one hand-off's bytes each
        assert rows[mode]["offload_bytes"] % (2 << 20) == 0


def test_the_text_report_over_tcp_names_the_path_and_its_pacing() -> None:
    run = bench(*SMALL, "--transports", "tcp", "--same-host", "ucx")
    assert run.returncode == 0, run.stderr
    assert "path: ucx" in run.stdout
    assert "the offload goes in 1 MiB windows" in run.stdout


@pytest.mark.parametrize("flag,value,least", [("--offload-ratio", "9", 10),
                                              ("--handoff-blocks", "0", 1),
                                              ("--iters", "0", 1)])
def test_a_bad_value_exits_2_naming_the_flag(flag, value, least) -> None:
    run = bench(flag, value)
    assert run.returncode == 2
    assert f"{flag} must be at least {least}, got {value}" in run.stderr
