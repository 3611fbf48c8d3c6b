"""kvmove inside serving engines: ``kvmove.integrations.vllm`` is vLLM's KV connector."""
