"""The reference engine over a ``KVStore`` (``kvmove/engine/prefix_store.py``).

Each case runs prompts through a fresh colocated worker (an empty live cache) over a store an
earlier worker filled, so every reused block comes from the store. Stores load whatever they
hold (``load_policy="always"``) except where the decision itself is tested: with the tiny
model, whether a 2 KiB block loads faster than it computes depends on the machine. The
promises: the tokens are those of the engine with no store; the stored prefix is loaded
(``num_stored`` counts the tokens whose KV came from the store: every full block but the one
holding the last prompt token, which is always computed); a corrupt block is recomputed, never
served; the store's "recompute" decision is followed; every block comes back. Timing is left to
``kvmove-bench store`` (TTFT recompute vs host hit vs disk hit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmove import DiskTier, HostTier, KVStore
from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import Request, SamplingParams
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.worker import EngineWorker
from kvmove.errors import ConfigError

BLOCK = 4
NUM_BLOCKS = 256
LENGTHS = (3, 5, 17, 40, 63, 150)  # under, at and over a block
MAX_TOKENS = 8
WAIT = 30.0
TINY = MODEL_PRESETS["tiny"]
LAYOUT = TINY.kv_spec(BLOCK)


def prompts() -> list[list[int]]:
    return [[(5 * i + 11 * n) % 250 + 1 for i in range(n)] for n in LENGTHS]


def usable_tokens(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.random(TINY, seed=0)


def run(model: LlamaForCausalLM, store: KVStore | None, batch: list[list[int]],
        **scheduler: object) -> list[Request]:
    """Every prompt through one fresh worker; checks every block came back."""
    worker = EngineWorker(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, store=store,
                          scheduler=SchedulerConfig(**scheduler))
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                for i, p in enumerate(batch)]
    for r in requests:
        worker.add_request(r)
    ended = worker.run()
    worker.close()  # waits for the offers: their blocks come back
    assert sorted(r.id for r in ended) == sorted(r.id for r in requests)
    assert worker.cache.pool.num_free == NUM_BLOCKS
    return requests


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> list[list[int]]:
    return [r.output for r in run(model, None, prompts(), chunk_size=None)]


@pytest.fixture(params=["host", "disk", "host+disk"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    tiers = {"host": [HostTier(1 << 20)], "disk": [DiskTier(tmp_path, 4 << 20)],
             "host+disk": [HostTier(LAYOUT.bytes_per_block * 16), DiskTier(tmp_path, 4 << 20)]}
    with KVStore(LAYOUT, tiers[request.param], load_policy="always") as s:
        yield s


@pytest.mark.parametrize("chunk_size", [None, 8])
def test_stored_prefixes_are_loaded_and_change_no_token(model, reference, store, chunk_size):
    first = run(model, store, prompts(), chunk_size=chunk_size)
    assert [r.output for r in first] == reference
    assert all(r.num_stored == 0 for r in first)
    second = run(model, store, prompts(), chunk_size=chunk_size)
    assert [r.output for r in second] == reference
    assert [r.num_stored for r in second] == [usable_tokens(p) for p in prompts()]
    stats = store.stats()
    served = sum(t.served for t in stats.tiers.values())
    assert served == sum(map(usable_tokens, prompts())) // BLOCK
    assert all(t.corrupt == 0 for t in stats.tiers.values())


def test_a_shared_prefix_is_loaded_for_a_new_suffix(model):
    """Only the common blocks come from the store; the new suffix is computed."""
    base = [(3 * i) % 200 + 1 for i in range(64)]
    other = base + [7, 8, 9, 10, 11]
    with KVStore(LAYOUT, [HostTier(1 << 20)], load_policy="always") as store:
        run(model, store, [base])
        (request,) = run(model, store, [other])
        (expected,) = run(model, None, [other])
    assert request.output == expected.output
    assert request.num_stored == 64


def test_a_restarted_disk_store_serves_the_prefix(model, reference, tmp_path):
    with KVStore(LAYOUT, [DiskTier(tmp_path, 4 << 20)], namespace="tiny:0") as store:
        run(model, store, prompts())
    with KVStore(LAYOUT, [DiskTier(tmp_path, 4 << 20)], namespace="tiny:0",
                 load_policy="always") as store:
        requests = run(model, store, prompts())
    assert [r.output for r in requests] == reference
    assert [r.num_stored for r in requests] == [usable_tokens(p) for p in prompts()]


def test_a_corrupt_block_is_recomputed_never_served(model, reference, tmp_path):
    """Every stored slot damaged on disk: every block fails its checksum, the engine
    recomputes, and the tokens are still the reference's."""
    with KVStore(LAYOUT, [DiskTier(tmp_path, 4 << 20)]) as store:
        run(model, store, prompts())
    data = tmp_path / "blocks.dat"
    raw = bytearray(data.read_bytes())
    slot = -(-LAYOUT.bytes_per_block // 4096) * 4096
    for offset in range(0, len(raw), slot):
        raw[offset + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with KVStore(LAYOUT, [DiskTier(tmp_path, 4 << 20)], load_policy="always") as store:
        requests = run(model, store, prompts())
        corrupt = store.stats().tiers["disk"].corrupt
    assert [r.output for r in requests] == reference
    assert all(r.num_stored == 0 for r in requests)
    assert corrupt == sum(1 for p in prompts() if usable_tokens(p))  # the first of each prompt


def test_a_recompute_decision_is_followed(model, reference):
    """A prefill measured as (absurdly) fast: loading never pays, nothing is loaded."""
    with KVStore(LAYOUT, [HostTier(1 << 20)]) as store:
        run(model, store, prompts())
        run(model, store, prompts()[-1:])  # a hit: the host tier's read bandwidth is measured
        store.observe_prefill(10**15, 1.0)
        requests = run(model, store, prompts())
        decisions = store.stats().decisions
    assert [r.output for r in requests] == reference
    assert all(r.num_stored == 0 for r in requests)
    assert decisions["recompute"] >= sum(1 for p in prompts() if usable_tokens(p))


def test_an_aborted_fetch_gives_its_blocks_back(model):
    prompt = prompts()[-1]
    with KVStore(LAYOUT, [HostTier(1 << 20)], load_policy="always") as store:
        run(model, store, [prompt])
        worker = EngineWorker(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, store=store)
        request = Request("r", prompt, SamplingParams(max_tokens=MAX_TOKENS))
        worker.add_request(request)
        worker.scheduler.schedule()  # admits it: the fetch starts
        assert [f.request for f in worker.store.fetching] == [request]
        assert worker.abort("r") is request and request.finished
        worker.store.drain(WAIT)
        assert not worker.store.fetching and not worker.has_work
        assert worker.cache.pool.num_free == NUM_BLOCKS
        worker.close()


def test_a_decode_worker_takes_no_store(model):
    with KVStore(LAYOUT, [HostTier(1 << 20)]) as store:
        with pytest.raises(ConfigError, match="decode worker"):
            EngineWorker(model, role="decode", num_blocks=NUM_BLOCKS, block_size=BLOCK, store=store)


def test_a_store_needs_prefix_caching(model):
    with KVStore(LAYOUT, [HostTier(1 << 20)]) as store:
        with pytest.raises(ConfigError, match="prefix_caching"):
            EngineWorker(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, store=store,
                         scheduler=SchedulerConfig(prefix_caching=False))


def test_a_store_of_another_layout_is_refused(model):
    with KVStore(TINY.kv_spec(BLOCK * 2), [HostTier(1 << 20)]) as store:
        with pytest.raises(ConfigError, match="layout"):
            EngineWorker(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, store=store)
