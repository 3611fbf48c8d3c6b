"""Text form of ``kvmove-bench engine`` results (the CLI prints it; ``--json`` is
``EngineReport.to_dict()``)."""

from __future__ import annotations

from kvmove.bench.engine import EngineReport, PrefillRow
from kvmove.bench.report import _aligned, _ms

__all__ = ["format_engine"]


def format_engine(report: EngineReport) -> str:
    """Header, the prefill table, the decode table, and the asymmetry in two lines."""
    return "\n".join([_header(report), "", *_prefill_table(report), "", *_decode_table(report),
                      "", *_asymmetry_lines(report), "",
                      f"measured in {report.wall_seconds:.1f} s"])


def _header(report: EngineReport) -> str:
    config, model = report.config, report.config.model_config
    return (f"{config.model} Llama ({model.num_layers} layers, hidden {model.hidden_size}, "
            f"{model.num_heads} heads / {model.num_kv_heads} KV heads, head_dim "
            f"{model.head_dim}, {model.dtype}, {report.num_params / 1e6:.1f} M parameters, "
            f"random weights), KV {report.kv_bytes_per_token:,} B per token in blocks of "
            f"{config.block_size}; LlamaForCausalLM.forward on the CPU, torch "
            f"{report.torch_version} with {report.num_threads} threads; median of "
            f"{config.iters} iterations after a warm-up")


def _prefill_table(report: EngineReport) -> list[str]:
    head = ["prefill", "prompts", "tokens each", "ms", "ms/token", "tokens/s", "vs 1 prompt"]
    rows = [_prefill_cells("one prompt", report.prefill, "")]
    rows += [_prefill_cells("batched" if row.batch_size > 1 else "baseline", row,
                            f"{report.prefill_ratio(row):.2f}x")
             for row in report.prefill_batches]
    return _aligned(head, rows, left={0})


def _prefill_cells(label: str, row: PrefillRow, ratio: str) -> list[str]:
    return [label, str(row.batch_size), f"{row.prompt_tokens:,}", _ms(row.median_seconds * 1e3),
            f"{row.ms_per_token:.3f}", f"{row.tokens_per_s:,.0f}", ratio]


def _decode_table(report: EngineReport) -> list[str]:
    config = report.config
    head = [f"decode ({config.context_tokens:,} tokens of context, {config.decode_steps} steps)",
            "batch", "step ms", "tokens/s", "tokens/s vs batch 1", "step time vs batch 1"]
    rows = [["", str(row.batch_size), _ms(row.step_seconds * 1e3), f"{row.tokens_per_s:,.1f}",
             f"{report.decode_ratio(row):.2f}x", f"{report.step_time_ratio(row):.2f}x"]
            for row in report.decode]
    return _aligned(head, rows, left={0})


def _asymmetry_lines(report: EngineReport) -> list[str]:
    decode = max(report.decode, key=lambda row: row.batch_size)
    prefill = max(report.prefill_batches, key=lambda row: row.batch_size)
    return [
        f"asymmetry: batching {decode.batch_size} sequences multiplies decode throughput by "
        f"{report.decode_ratio(decode):.2f} (each step takes {report.step_time_ratio(decode):.2f}x"
        f" as long); batching {prefill.batch_size} prompts multiplies prefill's by "
        f"{report.prefill_ratio(prefill):.2f}",
        f"a {report.prefill.prompt_tokens:,}-token prefill runs {report.prefill.tokens_per_s:,.0f}"
        f" tokens/s, {report.prefill_over_decode:.0f}x decode's at batch 1",
    ]
