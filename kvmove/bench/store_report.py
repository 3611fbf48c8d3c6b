"""Text form of ``kvmove-bench store`` results (the CLI prints it; ``--json`` is
``StoreReport.to_dict()``)."""

from __future__ import annotations

from kvmove.bench.store import StoreReport, TierRow, TtftRow
from kvmove.bench.report import _aligned, _human_bytes, _ms

__all__ = ["format_store"]


def format_store(report: StoreReport) -> str:
    """Header, the tier table, the TTFT table with the store's decisions."""
    config = report.config
    lines = [f"{config.model} KV of {config.tokens:,} tokens ({config.dtype}, blocks of "
             f"{config.block_size}): {_human_bytes(report.nbytes)}; disk tier "
             f"{'O_DIRECT' if report.direct else 'buffered (O_DIRECT refused here)'}; median "
             f"of {config.iters} runs after a warm-up", "", *_tier_table(report.tiers)]
    if report.ttft:
        lines += ["", f"time to first token of a repeated {config.prompt_tokens:,}-token prompt "
                  f"({config.engine_model} engine, one request, fresh engine each run)",
                  *_ttft_table(report)]
    return "\n".join([*lines, "", f"measured in {report.wall_seconds:.1f} s"])


def _tier_table(rows: list[TierRow]) -> list[str]:
    head = ["tier", "op", "GB/s", "baseline", "GB/s", "tier/baseline", "also", "GB/s"]
    cells = [[r.tier, r.op, f"{r.gbps():.2f}", r.baseline, f"{r.gbps(r.baseline_seconds):.2f}",
              f"{r.ratio:.2f}x", r.other_baseline or "",
              f"{r.gbps(r.other_seconds):.2f}" if r.other_seconds else ""] for r in rows]
    return _aligned(head, cells, left={0, 1, 3, 6})


def _ttft_table(report: StoreReport) -> list[str]:
    recompute = next(r for r in report.ttft if r.case == "recompute").median
    head = ["case", "TTFT ms", "vs recompute", "tokens loaded", "decision", "est. load ms",
            "est. recompute ms", "picked the faster"]
    return _aligned(head, [_ttft_cells(report, r, recompute) for r in report.ttft],
                    left={0, 4})


def _ttft_cells(report: StoreReport, row: TtftRow, recompute: float) -> list[str]:
    def ms(value: float | None) -> str:
        return "" if value is None else _ms(value * 1e3)

    picked = "" if row.decision is None else ("yes" if report.picked_faster(row) else "NO")
    return [row.case, ms(row.median), f"{recompute / row.median:.1f}x faster" if
            row.case != "recompute" else "", f"{row.loaded_tokens:,}", row.decision or "",
            ms(row.load_seconds), ms(row.recompute_seconds), picked]
