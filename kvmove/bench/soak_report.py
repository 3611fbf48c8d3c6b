"""``kvmove-bench soak``'s configuration, its report and the report's text (``soak`` runs it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmove.errors import ConfigError

__all__ = ["DEFAULT_FAULTS", "Sample", "SoakConfig", "SoakReport", "format_soak"]

# the chaos test's mix (tests/test_chaos.py): a failed post, dropped and late messages and a
# corrupted block now and then, in every worker's agent
DEFAULT_FAULTS = "fail_post=45,drop_message=0.01,delay_message_ms=1,corrupt_every=37,seed=11"


@dataclass(frozen=True)
class SoakConfig:
    duration: float = 60.0      # seconds of load
    rate: float = 4.0           # requests per second (Poisson)
    max_tokens: int = 10
    faults: str = DEFAULT_FAULTS
    stall_every: float = 20.0   # seconds between stalls (0: none)
    stall_seconds: float = 8.0  # past the transfer deadline and the Cancel's: a cut-off
    kill_every: float = 30.0    # seconds between kills (0: none)
    sample_every: float = 5.0
    num_blocks: int = 256
    transfer_timeout: float = 2.0
    request_timeout: float = 30.0
    settle: float = 60.0
    model: str = "tiny"
    seed: int = 0

    def check(self) -> None:
        for name in ("duration", "rate", "max_tokens", "stall_seconds", "sample_every",
                     "num_blocks", "transfer_timeout", "request_timeout", "settle"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"soak {name} must be positive, got {getattr(self, name)!r}")
        for name in ("stall_every", "kill_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"soak {name} must be 0 (never) or positive, got "
                                  f"{getattr(self, name)!r}")

    def server_arguments(self) -> list[str]:
        return ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--model", self.model,
                "--chunk-size", "32", "--num-blocks", str(self.num_blocks),
                "--transfer-timeout", str(self.transfer_timeout),
                "--request-timeout", str(self.request_timeout)]


@dataclass
class Sample:
    at: float  # seconds since the load began
    server_mib: float
    pool_mib: dict[str, float]
    ok: int
    errors: int


@dataclass
class SoakReport:
    config: SoakConfig
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # ok, error, wrong, hung
    errors: Counter = field(default_factory=Counter)    # by kind
    wrong: list[str] = field(default_factory=list)      # the first few, for the report
    stalls: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)  # injected, summed over processes
    samples: list[Sample] = field(default_factory=list)
    leaked_blocks: int = 0
    quarantined_blocks: int = 0
    settle_seconds: float | None = None  # None: not settled within config.settle
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not (self.outcomes["wrong"] or self.outcomes["hung"] or self.leaked_blocks or
                    self.quarantined_blocks or self.settle_seconds is None)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcomes": dict(self.outcomes), "errors": dict(self.errors),
                "passed": self.passed}


def format_soak(report: SoakReport) -> str:
    c, o = report.config, report.outcomes
    lines = [
        f"kvmove-bench soak: kvmove-serve disagg, 1 prefill + 1 decode worker ({c.model}), "
        f"{c.duration:g} s at {c.rate:g} requests/s, {c.max_tokens} tokens each",
        f"trouble:  faults {c.faults!r} (injected: {report.faults or 'none seen'}); "
        f"{len(report.stalls)} stalls of {c.stall_seconds:g} s {report.stalls}; "
        f"{len(report.kills)} kills {report.kills}",
        f"requests: {report.sent} sent: {o['ok']} ok, {o['error']} failed with an error, "
        f"{o['wrong']} wrong, {o['hung']} hung (no answer in {c.request_timeout:g} s)",
    ]
    lines += [f"  error   {n:5d} x {kind}" for kind, n in report.errors.most_common()]
    lines += [f"  WRONG   {detail}" for detail in report.wrong]
    settled = (f"settled {report.settle_seconds:g} s after the load" if
               report.settle_seconds is not None else f"NOT settled after {c.settle:g} s")
    lines.append(f"blocks:   {report.leaked_blocks} leaked, {report.quarantined_blocks} "
                 f"quarantined ({settled}; {c.num_blocks} per worker)")
    roles = sorted({role for s in report.samples for role in s.pool_mib})
    lines.append("memory (RSS, MiB):")
    lines.append(f"  {'at s':>7}  {'server':>7}  " + "  ".join(f"{r:>8}" for r in roles) +
                 f"  {'ok':>6}  {'errors':>6}")
    for s in report.samples:
        lines.append(f"  {s.at:7.1f}  {s.server_mib:7.1f}  " +
                     "  ".join(f"{s.pool_mib.get(r, 0.0):8.1f}" for r in roles) +
                     f"  {s.ok:6d}  {s.errors:6d}")
    lines.append(f"verdict:  {'PASS' if report.passed else 'FAIL'} (0 wrong, 0 hung, 0 leaked "
                 f"needed) in {report.seconds:g} s")
    return "\n".join(lines)
