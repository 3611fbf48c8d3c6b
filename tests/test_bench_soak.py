"""``kvmove-bench soak``, short: kvmove-serve disaggregated under load with faults in every
agent, a stall and a kill, as the README installs it. The 10-minute run's table is in
docs/serving.md; this is its CI version (issue 28: 0 wrong, 0 hung, 0 leaked). The check of
the answers can fail: with one reference answer changed, the soak counts it wrong and fails.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvmove.bench import soak

from helpers.serve import WORKDIR


def test_a_short_soak_serves_with_no_wrong_answer_no_hang_no_leak() -> None:
    command = [sys.executable, "-m", "kvmove.bench.cli", "soak", "--duration", "20",
               "--stall-every", "5", "--stall-seconds", "4", "--kill-every", "11",
               "--sample-every", "4", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=WORKDIR, timeout=400)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(result.stdout)
    outcomes = report["outcomes"]
    assert report["passed"] and not outcomes.get("wrong") and not outcomes.get("hung")
    assert report["leaked_blocks"] == 0 and report["quarantined_blocks"] == 0
    assert report["settle_seconds"] is not None
    assert outcomes["ok"] >= report["sent"] // 3, report
    assert report["stalls"] and report["kills"], report
    assert sum(report["faults"].values()) > 0, report
    assert len(report["samples"]) >= 5
    assert all(s["server_mib"] > 0 and set(s["pool_mib"]) == {"decode", "prefill"}
               for s in report["samples"])


def test_a_wrong_answer_fails_the_soak(monkeypatch) -> None:
    """The reference with one answer changed (as a hand-off of wrong KV would change it)."""
    real = soak.greedy_answers

    def one_wrong(model: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
        answers = real(model, prompts, max_tokens)
        return {p: a if i else a + "!" for i, (p, a) in enumerate(answers.items())}

    monkeypatch.setattr(soak, "greedy_answers", one_wrong)
    report = soak.run(soak.SoakConfig(duration=5, rate=8, faults="", stall_every=0,
                                      kill_every=0, sample_every=2, seed=3))
    assert report.outcomes["wrong"] > 0 and report.outcomes["ok"] > 0, report.outcomes
    assert not report.passed
    assert "WRONG" in soak.format_soak(report) and "FAIL" in soak.format_soak(report)


def test_bad_options_are_refused_naming_the_value() -> None:
    for option, value, words in (("--rate", "-1", "rate must be positive, got -1.0"),
                                 ("--kill-every", "-2", "kill_every must be 0 (never) or"),
                                 ("--model", "huge", "'huge'")):
        result = subprocess.run([sys.executable, "-m", "kvmove.bench.cli", "soak", option, value],
                                capture_output=True, text=True, cwd=WORKDIR, timeout=120)
        assert result.returncode == 2 and words in result.stderr, (option, result.stderr)
