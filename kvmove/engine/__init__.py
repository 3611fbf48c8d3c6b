"""kvmove's reference prefill/decode engine: a Llama model whose paged KV cache lives in kvmove
memory, a continuous-batching scheduler, and prefill/decode workers that hand requests off
through kvmove's layer-wise streaming. Needs torch (``pip install kvmove[engine]``)."""
