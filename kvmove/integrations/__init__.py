"""kvmove inside serving engines: ``kvmove.integrations.vllm`` is vLLM's KV connector,
``kvmove.integrations.sglang`` SGLang's HiCache storage backend, ``kvmove.integrations.lmcache``
LMCache's storage (an L2 adapter and a remote-storage plugin); each imports its engine, and
``import kvmove`` imports none of them."""
