"""``kvmove-bench scale`` as a user runs it: both row sets, every lease and peer count asked
for, the bytes verified (a mismatch exits 1), and bad counts refused with exit 2 naming the
flag. What the figures are is the benchmark's business (no thresholds here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.checks import WORKDIR


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "scale", *args],
                          capture_output=True, text=True, timeout=180, cwd=WORKDIR)


def test_json_has_a_row_per_lease_count_and_per_peer_count() -> None:
    run = bench("--leases", "1,7", "--peers", "1,3", "--iters", "2", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert [r["leases"] for r in report["leases"]] == [1, 7]
    assert [r["peers"] for r in report["peers"]] == [1, 3]
    assert report["lease_nbytes"] == 4 * 64 * 1024
    for row in report["leases"]:
        assert row["seconds"] > 0 and row["per_lease_us"] == pytest.approx(
            row["seconds"] / row["leases"] * 1e6)
    for row in report["peers"]:
        assert row["nbytes"] == row["peers"] * 16 * report["lease_nbytes"]
        assert 0 < row["connect_median_s"] <= row["connect_max_s"]


def test_the_text_report_over_tcp_names_the_path() -> None:
    run = bench("--leases", "2", "--peers", "2", "--iters", "1", "--transports", "tcp",
                "--same-host", "ucx")
    assert run.returncode == 0, run.stderr
    assert "transports tcp, same host: ucx" in run.stdout.splitlines()[0]
    assert "Concurrent leases" in run.stdout and "Peers on one receiver" in run.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--leases", "0"], "each count must be in [1, 100000]"),
    (["--leases", "a"], "expected counts like 1,10,100"),
    (["--peers", "4,2"], "--peers must rise, got 4,2"),
    (["--iters", "0"], "--iters must be at least 1, got 0"),
])
def test_bad_counts_are_refused_naming_the_flag(args: list[str], message: str) -> None:
    run = bench(*args)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
