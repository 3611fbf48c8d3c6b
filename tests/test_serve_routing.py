"""KV-aware routing end to end (issue 19): a real ``kvmove-serve`` with two colocated workers,
the official ``openai`` client, and ``/metrics``.

One prompt prefix is served once, then repeated by concurrent requests. With ``--routing kv``
every repeat goes to the worker whose prefix cache holds the prefix (its ``kv`` events told
the router), and lands on all of it; with ``--routing least-loaded`` the repeats are spread
over both workers, so some land where the prefix is not. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio

import pytest

from helpers.serve import Server, wait_until

PREFIX = "".join(chr(ord("a") + i % 26) for i in range(511))  # with BOS: 32 blocks of 16
PREFIX_TOKENS = 512
REPEATS = 4
MAX_TOKENS = 48


def _sum(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def _by_worker(samples: dict, reason: str) -> dict[str, float]:
    return {dict(ls)["worker"]: v for (n, ls), v in samples.items()
            if n == "kvmove_routing_decisions_total" and dict(ls)["reason"] == reason}


async def _repeats(server: Server) -> list:
    client = server.async_client()
    try:
        return await asyncio.gather(*[
            client.completions.create(model="tiny", prompt=f"{PREFIX} {i}",
                                      max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
            for i in range(REPEATS)])
    finally:
        await client.close()


def _serve_shared_prefix(routing: str) -> tuple[str, dict]:
    """Serves the prefix once, waits until the router's index holds it, then the repeats;
    the worker that served it first and ``/metrics`` after."""
    server = Server("--mode", "colocated", "--workers", "2", "--no-restart",
                    "--routing", routing)
    try:
        first = server.client().completions.create(model="tiny", prompt=f"{PREFIX} x",
                                                   max_tokens=2, extra_body={"ignore_eos": True})
        assert first.usage.completion_tokens == 2
        [holder] = [w for w, n in _by_worker(server.samples(), "no_match" if routing == "kv"
                                             else "least_loaded").items() if n == 1]
        wait_until(lambda: _sum(server.samples(), "kvmove_routing_indexed_blocks",
                                worker=holder, medium="cache") >= PREFIX_TOKENS // 16,
                   30.0, f"the router's index holding {holder}'s prefix")
        for response in asyncio.run(_repeats(server)):
            assert response.usage.completion_tokens == MAX_TOKENS
            assert len(response.choices[0].text) > 0
        return holder, server.samples()
    finally:
        server.close()


def test_kv_routing_sends_repeat_prefixes_to_the_worker_that_holds_them() -> None:
    holder, samples = _serve_shared_prefix("kv")
    assert _by_worker(samples, "kv_hit") == {holder: REPEATS}
    assert _sum(samples, "kvmove_routing_decisions_total", reason="load") == 0
    # the first request matched nothing, every repeat its whole prefix
    assert _sum(samples, "kvmove_routing_matched_tokens_sum") == REPEATS * PREFIX_TOKENS
    assert _sum(samples, "kvmove_routing_matched_tokens_count") == REPEATS + 1


def test_least_loaded_spreads_repeat_prefixes_over_workers_without_them() -> None:
    holder, samples = _serve_shared_prefix("least-loaded")
    spread = _by_worker(samples, "least_loaded")
    assert len(spread) == 2 and all(n >= 1 for n in spread.values()), spread
    assert _sum(samples, "kvmove_routing_matched_tokens_sum") < REPEATS * PREFIX_TOKENS
    assert _sum(samples, "kvmove_routing_decisions_total", reason="kv_hit") == 0


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
