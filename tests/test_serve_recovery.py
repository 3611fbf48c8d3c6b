"""A disaggregated pair recovers from a disconnect by itself (issue 28, row 1): the prefill
worker stalls (SIGSTOP) in the middle of a hand-off, long enough that the decode worker gives
up its lease, cancels and, unanswered, cuts the prefill off. Once the prefill runs again the
next requests are served (they all got HTTP 500, "unknown peer 'prefill-0'", and the decode's
free blocks leaked): the decode worker connects to it again on fresh endpoints by itself
(``kvmove/serve/peer_links.py``), and the cut-off lease's quarantine ends with the prefill's
Abort over the new connection. A real kvmove-serve and the official client; every wait has a
deadline."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai

from helpers.serve import Server, wait_until

NUM_BLOCKS = 2048  # kvmove-serve's --num-blocks default
STALL_SECONDS = 20.0  # the lease (1 s) and the Cancel's timeout (5 s) pass within this
MAX_TOKENS = 8


def _metric(server: Server, name: str, worker: str) -> float:
    return server.samples().get((name, (("worker", worker),)), 0.0)


def test_after_a_stalled_prefill_is_cut_off_the_next_requests_are_served() -> None:
    # Each layer's post waits 300 ms on the prefill (KVMOVE_FAULTS): the stall lands mid-stream.
    server = Server("--mode", "disagg", "--prefill", "1", "--decode", "1", "--no-restart",
                    "--transfer-timeout", "1",
                    env={"KVMOVE_FAULTS": "delay_post_us=300000"})
    try:
        prefill = server.worker("prefill-0")["pid"]
        client = server.client(timeout=60.0)
        failed: list[BaseException] = []

        def first() -> None:
            try:
                client.completions.create(model="tiny", prompt="stalled " * 20,
                                          max_tokens=MAX_TOKENS, temperature=0.0)
            except openai.APIError as error:  # cut off mid-hand-off: it may fail
                failed.append(error)

        thread = threading.Thread(target=first, daemon=True)
        thread.start()
        wait_until(lambda: _metric(server, "kvmove_agent_leases_granted_total", "decode-0") >= 1,
                   10.0, "the decode worker leased blocks to the prefill")
        time.sleep(0.1)  # the prefill said Begin and posts its layers
        os.kill(prefill, signal.SIGSTOP)
        try:
            wait_until(lambda: _metric(server, "kvmove_agent_senders_disconnected_total",
                                       "decode-0") >= 1,
                       STALL_SECONDS, "the decode worker cut the silent prefill off")
            # cut off, the pair serves no hand-off: /health says so (it said ok)
            wait_until(lambda: server.worker("decode-0").get("lost_peers") == ["prefill-0"]
                       and server.health()["status"] == "degraded", 5.0,
                       lambda: f"/health naming the lost peer: {server.health()}")
        finally:
            os.kill(prefill, signal.SIGCONT)
        thread.join(60.0)
        # With no request to make it, the decode worker connects to the prefill again, and the
        # cut-off lease's quarantine ends with the prefill's Abort over the new connection.
        wait_until(lambda: _metric(server, "kvmove_worker_free_blocks", "decode-0") == NUM_BLOCKS
                   and _metric(server, "kvmove_agent_blocks_quarantined", "decode-0") == 0,
                   15.0, lambda: f"decode-0's blocks all back: {server.health()}")
        for i in range(4):
            response = client.completions.create(model="tiny", prompt=f"after {i} " * 8,
                                                 max_tokens=MAX_TOKENS, temperature=0.0,
                                                 extra_body={"ignore_eos": True})
            assert response.usage.completion_tokens == MAX_TOKENS
        assert server.health()["status"] == "ok"
    finally:
        server.close()
