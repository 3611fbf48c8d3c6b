"""``kvmove-bench stream`` as a user runs it: the end-to-end headline, the two kinds of
simulated prefill, and checksums on both hand-offs by default with their cost measured in the
same run. What the figures are is the benchmark's business (no thresholds here); that each
is there, consistent and verified is this test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.checks import WORKDIR

TINY = ["stream", "--model", "llama-3.2-1b", "--tokens", "64", "--iters", "2"]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmove.bench.cli", *TINY, *args],
                          capture_output=True, text=True, timeout=180, cwd=WORKDIR)


@pytest.mark.parametrize("compute", ["cpu", "accelerator"])
def test_the_report_leads_with_the_end_to_end_speedup(compute: str) -> None:
    run = bench("--compute", compute)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "per-block checksums on both hand-offs" in lines[0]
    assert lines[2].startswith("end to end (prefill + hand-off): streamed ")
    assert ("a timed wait per layer" in run.stdout) == (compute == "accelerator")
    assert "checksums: the streamed hand-off ended" in run.stdout


def test_json_has_both_ends_and_the_checksum_cost() -> None:
    run = bench("--compute", "accelerator", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["config"]["compute"] == "accelerator" and report["config"]["checksums"]
    assert report["verified"] is True
    assert report["speedup"] == pytest.approx(report["bulk_done_ms"] / report["stream_done_ms"])
    assert isinstance(report["checksum_cost"], float)
    for it in report["iterations"]:
        assert it["plain_done_seconds"] > 0 and it["plain_mismatched_blocks"] == 0


def test_no_checksums_runs_two_hand_offs_and_says_so() -> None:
    run = bench("--no-checksums", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["config"]["checksums"] is False and report["checksum_cost"] is None
    assert all(it["plain_done_seconds"] is None for it in report["iterations"])
    text = bench("--no-checksums")
    assert "no checksums (--no-checksums)" in text.stdout
    assert "checksums: the streamed" not in text.stdout


def test_a_compute_kind_it_does_not_know_is_a_usage_error() -> None:
    run = bench("--compute", "gpu")
    assert run.returncode == 2
    assert "invalid choice: 'gpu'" in run.stderr
