"""``kvmove-serve``: the reference engine behind an OpenAI-compatible API, colocated or
disaggregated (prefill and decode workers, KV streamed over kvmove). See docs/serving.md."""
