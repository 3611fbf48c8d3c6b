"""The planner end to end (issue 19): a real disaggregated ``kvmove-serve --planner`` whose
bounds it starts outside of, so that its first decisions are known: add a prefill worker
(``below_min``) and drain a decode worker (``above_max``) while concurrent requests stream
through both decode workers. No request is lost: every one completes with all its tokens,
the drained worker ends and is not started again, and the added one takes requests. The
official ``openai`` client; every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import re

from helpers.serve import Server, process_alive, wait_until

REQUESTS = 6
MAX_TOKENS = 384   # each request decodes for tens of seconds: the first decision (4 s) finds
                   # them (1,024 took up to 4 min of a full run here, near the 300 s timeout)
STAGGER_SECONDS = 0.3  # between arrivals: a burst would reserve every request's blocks on
                       # one decode worker (the others' stats not yet updated)


async def _complete_all(server: Server, n: int, max_tokens: int = MAX_TOKENS,
                        stagger: float = STAGGER_SECONDS) -> list:
    client = server.async_client(timeout=300.0)

    async def one(i: int):
        await asyncio.sleep(i * stagger)
        return await client.completions.create(model="tiny", prompt=f"request {i} " * 8,
                                               max_tokens=max_tokens, temperature=0.0,
                                               extra_body={"ignore_eos": True})
    try:
        return await asyncio.gather(*[one(i) for i in range(n)])
    finally:
        await client.close()


def _planned(server: Server, pool: str, action: str, reason: str) -> float:
    return server.samples().get(("kvmove_planner_decisions_total",
                                 (("action", action), ("pool", pool), ("reason", reason))), 0)


def test_a_drain_under_load_loses_no_request_and_an_added_worker_serves() -> None:
    server = Server("--mode", "disagg", "--prefill", "1", "--decode", "2", "--no-restart",
                    "--planner", "--prefill-workers", "2:2", "--decode-workers", "1:1",
                    "--planner-interval", "4")
    try:
        decode_pids = {w["name"]: w["pid"] for w in server.health()["workers"]
                       if w["role"] == "decode"}
        for response in asyncio.run(_complete_all(server, REQUESTS)):
            assert response.usage.completion_tokens == MAX_TOKENS
            assert response.choices[0].finish_reason == "length"
        assert _planned(server, "decode", "drain", "above_max") == 1
        assert _planned(server, "prefill", "add", "below_min") == 1
        drained = re.search(r"draining (decode-\d): (\d+) requests in flight",
                            server.stderr_text(tail=None))
        assert drained, server.stderr_text()
        name, in_flight = drained.group(1), int(drained.group(2))
        assert in_flight > 0, "the drain found no request to finish: not under load"
        wait_until(lambda: not process_alive(decode_pids[name]), 30.0, f"{name} ending")
        # its end is seen by the server's monitor a moment later: then /health drops it
        wait_until(lambda: name not in [w["name"] for w in server.health()["workers"]], 10.0,
                   lambda: f"{name} retired: {server.health()}")
        wait_until(lambda: [w["name"] for w in server.health()["workers"]
                            if w["role"] == "prefill" and w["ready"]] == ["prefill-0",
                                                                          "prefill-1"],
                   60.0, lambda: f"prefill-1 ready: {server.health()}")
        health = server.health()
        assert [w["name"] for w in health["workers"] if w["role"] == "decode"] == [
            n for n in decode_pids if n != name]
        assert health["status"] == "ok", health
        assert server.samples()[("kvmove_pool_workers", (("pool", "decode"),))] == 1
        # the pools as planned serve, the new prefill worker too (a burst: its second request
        # goes where no prompt is pending)
        for response in asyncio.run(_complete_all(server, 4, max_tokens=16, stagger=0.0)):
            assert response.usage.completion_tokens == 16
        routed = {dict(ls)["worker"] for (n, ls), v in server.samples().items()
                  if n == "kvmove_routing_decisions_total" and v > 0}
        assert "prefill-1" in routed
        assert server.samples().get(("kvmove_requests_total", (("outcome", "length"),))) == \
            REQUESTS + 4
    finally:
        server.close()
