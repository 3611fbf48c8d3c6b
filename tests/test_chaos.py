"""Chaos: kvmove-serve (disaggregated) under load, with faults injected in every worker's kvmove
agent and workers SIGKILLed and started again at random.

What must hold (issue 14): every request that completes has exactly the colocated greedy
text; every other one ends with a clear error event; none hangs past its deadline; at the end
every pool's blocks are free, every lease released, and no process is left. Traffic is a
bounded, seeded Poisson load from the official ``openai`` client, all on loopback; the run is
bounded in requests and in time. Requests that arrive while a pool's only worker is being
started again wait for it (within their deadline), so most of them complete.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvmove.engine.model import MODEL_PRESETS
from kvmove.engine.tokenizer import ByteTokenizer

from helpers.greedy import greedy_tokens
from helpers.serve import Server, process_alive, wait_until

TINY = MODEL_PRESETS["tiny"]
TOKENIZER = ByteTokenizer(TINY.bos_token_id, TINY.eos_token_id)
NUM_BLOCKS = 256
MAX_TOKENS = 10
REQUESTS = 70
RATE = 6.0             # requests per second (Poisson)
KILLS = 4
CLIENT_SECONDS = 30.0  # no request may take longer, whatever happened to it
FAULTS = "fail_post=45,drop_message=0.01,delay_message_ms=1,corrupt_every=37,seed=11"
ARGS = ("--mode", "disagg", "--prefill", "1", "--decode", "1", "--chunk-size", "32",
        "--num-blocks", str(NUM_BLOCKS), "--transfer-timeout", "3", "--request-timeout", "20")
PROMPTS = ["a", "Hello, world!", "the quick brown fox jumps over the lazy dog",
           "".join("abcdefghij"[(i * 7) % 10] for i in range(60)),
           "".join("klmnopqrst"[(i * 3) % 10] for i in range(140))]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Greedy text of every prompt from a colocated engine here (no kvmove hand-off)."""
    return {p: TOKENIZER.decode(tokens) for p, tokens in
            greedy_tokens(PROMPTS, MAX_TOKENS).items()}


def test_chaos_no_wrong_answer_no_hang_no_leak(reference: dict[str, str]) -> None:
    rng = random.Random(14)
    server = Server(*ARGS, env={"KVMOVE_FAULTS": FAULTS})
    outcomes: list[tuple[str, str]] = []  # (kind, detail)
    faults: dict[tuple[str, int], dict] = {}  # the last counts each worker process reported
    kills: list[str] = []
    stop = threading.Event()
    try:
        client = server.client(timeout=CLIENT_SECONDS)

        def ask(prompt: str) -> tuple[str, str]:
            start = time.monotonic()
            try:
                result = client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})
            except openai.APITimeoutError:
                return "hung", f"{prompt!r}: no answer in {CLIENT_SECONDS} s"
            except openai.APIError as error:  # an error event or status: what clients see
                return ("error", str(error)) if str(error) else ("silent", repr(error))
            text = result.choices[0].text
            took = time.monotonic() - start
            return ("ok", f"{took:.2f}") if text == reference[prompt] else \
                ("wrong", f"{prompt!r}: {text!r} != {reference[prompt]!r}")

        def watch() -> None:
            while not stop.is_set():
                try:
                    for w in server.health()["workers"]:
                        if w.get("faults") is not None:
                            faults[w["name"], w["pid"]] = w["faults"]
                except Exception:  # noqa: BLE001 - busy or restarting a worker: next time
                    pass
                stop.wait(0.3)

        def killer() -> None:
            while len(kills) < KILLS and not stop.wait(rng.uniform(1.5, 3.0)):
                workers = [w for w in server.health()["workers"] if w["alive"] and w["ready"]]
                if not workers:
                    continue
                victim = rng.choice(workers)
                try:
                    import os
                    import signal

                    os.kill(victim["pid"], signal.SIGKILL)
                    kills.append(victim["name"])
                except ProcessLookupError:
                    pass

        watcher = threading.Thread(target=watch, daemon=True)
        chaos = threading.Thread(target=killer, daemon=True)
        watcher.start()
        chaos.start()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = []
            for _ in range(REQUESTS):
                futures.append(pool.submit(ask, rng.choice(PROMPTS)))
                time.sleep(rng.expovariate(RATE))
            for future in futures:
                outcomes.append(future.result(timeout=CLIENT_SECONDS + 10))
        chaos.join(30)
        elapsed = time.monotonic() - started

        # Every worker back, every block free, every lease released.
        wait_until(lambda: all(w["alive"] and w["ready"] for w in server.health()["workers"]),
                   90.0, "every worker started again and ready")

        def settled() -> bool:
            workers = server.health()["workers"]
            return all(w.get("free_blocks") == NUM_BLOCKS and
                       (w.get("agent") or {}).get("leases_active", 0) == 0 and
                       (w.get("agent") or {}).get("blocks_quarantined", 0) == 0
                       for w in workers)

        wait_until(settled, 30.0, lambda: f"pools not all free: {server.health()['workers']}")
        stop.set()
        watcher.join(5)
        kinds = {k: sum(1 for o in outcomes if o[0] == k) for k in
                 ("ok", "error", "wrong", "hung", "silent")}
        injected: dict[str, int] = {}
        for counts in faults.values():
            for kind, n in counts.items():
                injected[kind] = injected.get(kind, 0) + n
        print(f"chaos: {REQUESTS} requests in {elapsed:.1f} s, {len(kills)} kills {kills}, "
              f"faults injected {injected}, outcomes {kinds}")
        assert kinds["wrong"] == 0, [o for o in outcomes if o[0] == "wrong"]
        assert kinds["hung"] == 0, [o for o in outcomes if o[0] == "hung"]
        assert kinds["silent"] == 0, [o for o in outcomes if o[0] == "silent"]
        assert kinds["ok"] >= REQUESTS // 3, (kinds, [o for o in outcomes if o[0] != "ok"][:8])
        assert len(kills) == KILLS
        assert sum(injected.values()) > 0, faults
        metrics = server.get("/metrics").text
        assert "kvmove_worker_restarts_total" in metrics
    finally:
        stop.set()
        pids = list(server.worker_pids)
        server.close()  # fails if any process of it (restarted workers included) is left
        assert not any(process_alive(p) for p in pids)
