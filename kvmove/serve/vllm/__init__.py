"""``kvmove-serve --vllm-prefill URL... --vllm-decode URL...``: the OpenAI API in front of vLLM
prefill and decode instances, in vLLM's P/D protocol.

- ``proxy.py``: the protocol (pull, push), the app and its routes;
- ``pools.py``: the configuration, the instances and their pools, the Prometheus metrics;
- ``upstream.py``: one call to an instance, counted, timed, relayed.

The ``kv_transfer_params`` it speaks are ``kvmove.integrations.vllm.params``'s, shared with
kvmove's vLLM connector; nothing here needs vLLM installed.
"""
