"""The reference engine end to end (``kvmove/engine``): scheduler, workers and roles.

The flagship: prompts of mixed lengths, greedy, through a prefill worker and a decode worker in
two processes (KV streamed layer by layer over kvmove) give exactly the tokens of one colocated
worker. Then the scheduler's promises on one worker: chunked prefill and prefix reuse change
no token, reuse skips the cached blocks, a cache too small for the load finishes every request
(queued or preempted), and every block comes back. The model itself is checked against
``transformers`` in ``test_engine_model.py``.
"""

from __future__ import annotations

import logging

import pytest

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import FinishReason, Request, SamplingParams
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.worker import EngineWorker
from kvmove.errors import ConfigError

from helpers.engine_far import WorkerProcess

SEED = 0
BLOCK = 4
LENGTHS = (3, 4, 5, 17, 40, 63, 100, 150)  # under, at and over block and chunk boundaries
MAX_TOKENS = 12
TCP = {"transports": "tcp", "peer_timeout": 5.0}


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=SEED)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def colocated(model: LlamaForCausalLM, prompts: list[list[int]], params: SamplingParams,
              **scheduler: object) -> tuple[list[Request], EngineWorker]:
    worker = EngineWorker(model, num_blocks=scheduler.pop("num_blocks", 512), block_size=BLOCK,
                          scheduler=SchedulerConfig(**scheduler))
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for r in requests:
        worker.add_request(r)
    ended = worker.run()
    assert sorted(r.id for r in ended) == sorted(r.id for r in requests)
    return requests, worker


@pytest.fixture(scope="module")
def reference(model: LlamaForCausalLM) -> list[list[int]]:
    """Colocated greedy outputs: whole prompts, no prefix cache."""
    requests, _ = colocated(model, prompts(), greedy(), chunk_size=None, prefix_caching=False)
    return [r.output for r in requests]


# --- the flagship: prefill worker -> decode worker in two processes ---------------------------

@pytest.fixture(scope="module")
def disaggregated():
    kwargs = {"num_blocks": 256, "block_size": BLOCK, "agent_kwargs": TCP,
              "scheduler": {"chunk_size": 32}}
    prefill = WorkerProcess("prefill", SEED, **kwargs)
    try:
        decode = WorkerProcess("decode", SEED, **kwargs)
    except BaseException:
        prefill.stop()
        raise
    try:
        assert decode.call("connect", *prefill.address) == "prefill"
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def handoff(prefill: WorkerProcess, decode: WorkerProcess, rid: str, prompt: list[int],
            params: dict) -> None:
    """What a router does: the decode worker reserves blocks, leases and offers them to the
    prefill worker (by kvmove), which gets the prompt and which decode worker its KV goes to."""
    blocks = decode.call("reserve", rid, prompt, params)
    assert blocks is not None, "the decode cache is big enough for the whole test"
    decode.call("load", rid, "prefill")
    prefill.call("add", rid, prompt, params, "decode")


def test_disaggregated_greedy_equals_colocated(disaggregated, reference) -> None:
    prefill, decode = disaggregated
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    ids = [f"flag-{i}" for i in range(len(LENGTHS))]
    for rid, prompt in zip(ids, prompts()):
        handoff(prefill, decode, rid, prompt, params)
    handed = prefill.wait_ended(ids)
    done = decode.wait_ended(ids)
    assert all(h["reason"] == "handed_off" for h in handed.values()), handed
    for rid, want, prompt in zip(ids, reference, prompts()):
        got = done[rid]
        assert got["reason"] == "length", got
        assert got["output"] == want, f"{rid} ({len(prompt)} prompt tokens)"
        t = got["timings"]
        assert t["kv_start"] <= t["kv_end"] <= t["first_token"]
    # every block is back on both sides (cached blocks count as free)
    assert prefill.call("free_blocks") == 256
    assert decode.call("free_blocks") == 256


def test_seeded_sampling_disaggregated_equals_colocated(disaggregated, model) -> None:
    """The decode worker continues the request's seeded generator where the prefill worker,
    which drew the first token, left it."""
    prefill, decode = disaggregated
    params = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.9, "top_p": 0.9,
              "seed": 77}
    want, _ = colocated(model, prompts()[2:5], SamplingParams(**params))
    ids = [f"seeded-{i}" for i in range(3)]
    for rid, prompt in zip(ids, prompts()[2:5]):
        handoff(prefill, decode, rid, prompt, params)
    done = decode.wait_ended(ids)
    prefill.wait_ended(ids)
    assert [done[rid]["output"] for rid in ids] == [r.output for r in want]


def test_decode_reserve_is_back_pressure_not_an_error() -> None:
    model = LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=SEED)
    worker = EngineWorker(model, role="decode", num_blocks=8, block_size=BLOCK, name="d",
                          agent_kwargs=TCP)
    try:
        first = worker.reserve(Request("a", list(range(1, 25)), greedy(4)))  # 6 blocks
        assert first is not None and len(first) == 6
        assert worker.reserve(Request("b", list(range(1, 13)), greedy(4))) is None  # 3 > 2
        second = worker.reserve(Request("c", list(range(1, 9)), greedy(4)))  # 2 fit
        assert second is not None and not set(first) & set(second)
    finally:
        worker.close()


# --- one worker: chunking, prefix reuse, out of blocks ------------------------------------

@pytest.mark.parametrize("chunk_size", [1, 7, 32])
def test_chunked_prefill_changes_no_token(model, reference, chunk_size) -> None:
    requests, _ = colocated(model, prompts(), greedy(), chunk_size=chunk_size,
                            prefix_caching=False)
    assert [r.output for r in requests] == reference


def test_a_tight_token_budget_changes_no_token(model, reference) -> None:
    requests, worker = colocated(model, prompts(), greedy(), chunk_size=16,
                                 max_num_batched_tokens=20, prefix_caching=False)
    assert [r.output for r in requests] == reference
    assert worker.num_steps > sum(LENGTHS) // 20


def test_prefix_reuse_changes_no_token_and_skips_cached_blocks(model) -> None:
    shared = prompts()[6]  # 100 tokens: 25 full blocks
    tails = [[5, 6, 7], [9], list(range(30, 60))]
    first, _ = colocated(model, [shared + t for t in tails], greedy(), chunk_size=None,
                         prefix_caching=False)
    worker = EngineWorker(model, num_blocks=512, block_size=BLOCK,
                          scheduler=SchedulerConfig(chunk_size=None, prefix_caching=True))
    outputs, cached = [], []
    for i, tail in enumerate(tails):  # one after the other: each finds the last one's blocks
        request = Request(f"p{i}", shared + tail, greedy())
        worker.add_request(request)
        worker.run()
        outputs.append(request.output)
        cached.append(request.num_cached)
    assert outputs == [r.output for r in first]
    assert cached[0] == 0
    # the later ones reuse at least the 25 shared blocks (the first one's output blocks are
    # cached too, but differ from the later prompts' tails)
    assert all(c >= 25 * BLOCK for c in cached[1:]), cached


def test_out_of_blocks_every_request_finishes(model, reference, caplog) -> None:
    # 24 blocks of 4 tokens: the 150-token prompt alone needs 41 with its output... so use a
    # cache that fits each request alone but not all at once.
    caplog.set_level(logging.INFO, logger="kvmove.engine.scheduler")
    lengths_ok = [p for p in prompts() if len(p) <= 63]
    want = [out for p, out in zip(prompts(), reference) if len(p) <= 63]
    many = lengths_ok * 3
    requests, worker = colocated(model, many, greedy(), num_blocks=24, chunk_size=8,
                                 prefix_caching=False)
    assert [r.output for r in requests] == want * 3
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)
    assert worker.scheduler.num_preemptions > 0
    assert worker.cache.pool.num_free == 24
    preempted = [r for r in caplog.records if r.getMessage().startswith("preempted request")]
    assert len(preempted) == worker.scheduler.num_preemptions  # each one logged, at info


def test_a_request_that_can_never_fit_is_refused(model) -> None:
    worker = EngineWorker(model, num_blocks=8, block_size=BLOCK)
    with pytest.raises(ConfigError, match="needs up to 11 blocks.*has 8"):
        worker.add_request(Request("big", list(range(1, 41)), greedy(4)))
    assert not worker.has_work


# --- sampling -------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible(model) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=1234,
                            ignore_eos=True)
    a, _ = colocated(model, prompts()[:4], params)
    b, _ = colocated(model, prompts()[:4], params)
    assert [r.output for r in a] == [r.output for r in b]
    other = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=4321,
                           ignore_eos=True)
    c, _ = colocated(model, prompts()[:4], other)
    assert [r.output for r in a] != [r.output for r in c]


def test_eos_stops_a_request(model, reference) -> None:
    out = reference[3]
    eos = out[5]
    config = MODEL_PRESETS["tiny"]
    m = LlamaForCausalLM.random(config.__class__(**{**_fields(config), "eos_token_id": eos}),
                                seed=SEED)
    requests, _ = colocated(m, [prompts()[3]], SamplingParams(max_tokens=MAX_TOKENS))
    assert requests[0].output == out[:out.index(eos) + 1]
    assert requests[0].finish_reason is FinishReason.STOP


def _fields(config) -> dict:
    from dataclasses import asdict
    return asdict(config)


def _with(**overrides: object):
    config = MODEL_PRESETS["tiny"]
    return config.__class__(**{**_fields(config), **overrides})


@pytest.mark.parametrize("bad", [
    {"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"seed": -1},
    {"stop": ("",)},
])
def test_bad_sampling_params_are_refused(bad) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_stop_string_ends_the_request_and_is_cut_from_the_text(model, reference) -> None:
    out = reference[5]
    k = next(i for i, t in enumerate(out) if 32 <= t <= 126)  # the first printable ASCII byte
    stop = chr(out[k])
    requests, worker = colocated(model, [prompts()[5]],
                                 SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                stop=(stop,)))
    request = requests[0]
    assert request.output == out[:k + 1]
    assert request.finish_reason is FinishReason.STOP
    assert request.text == worker.tokenizer.decode(out[:k])
    assert stop not in request.text


def test_bad_worker_arguments_are_refused(model) -> None:
    with pytest.raises(ConfigError, match="role"):
        EngineWorker(model, role="both")
    worker = EngineWorker(model, num_blocks=16, block_size=BLOCK, tokenizer=None)
    # EOS among the bytes: no byte tokenizer
    nameless = EngineWorker(LlamaForCausalLM.random(_with(eos_token_id=65), seed=SEED),
                            num_blocks=16, block_size=BLOCK)
    assert worker.tokenizer is not None and nameless.tokenizer is None
    with pytest.raises(ConfigError, match="stop strings"):
        nameless.add_request(Request("s", [1, 2], SamplingParams(stop=("x",))))
    with pytest.raises(ConfigError, match="reserve"):
        worker.reserve(Request("r", [1, 2]))
    with pytest.raises(ConfigError, match="empty prompt"):
        Request("e", [])


def test_a_dead_prefill_worker_ends_its_requests_on_the_decode_side() -> None:
    """The decode worker reserved blocks and is loading; the prefill process is SIGKILLed:
    the request ends (abort, naming the peer) instead of waiting forever, and its blocks come
    back."""
    kwargs = {"num_blocks": 64, "block_size": BLOCK, "agent_kwargs": TCP}
    prefill = WorkerProcess("prefill", SEED, **kwargs)
    decode = WorkerProcess("decode", SEED, timeout=30.0, **kwargs)
    try:
        decode.call("connect", *prefill.address)
        params = {"max_tokens": 4, "ignore_eos": True}
        assert decode.call("reserve", "doomed", prompts()[4], params) is not None
        decode.call("load", "doomed", "prefill")
        prefill.process.kill()
        ended = decode.wait_ended(["doomed"])["doomed"]
        assert ended["reason"] == "abort"
        assert "prefill" in ended["error"], ended
        assert decode.call("free_blocks") == 64
    finally:
        decode.stop()
        prefill.stop()


def test_abort_drops_a_request_and_returns_its_blocks(model) -> None:
    worker = EngineWorker(model, num_blocks=64, block_size=BLOCK)
    keep, drop = Request("keep", prompts()[3], greedy()), Request("drop", prompts()[4], greedy())
    worker.add_request(keep)
    worker.add_request(drop)
    worker.step()
    assert drop.blocks and drop in worker.scheduler.running
    assert worker.abort("drop") is drop
    assert drop.finish_reason is FinishReason.ABORT and not drop.blocks
    assert worker.abort("unknown") is None
    worker.run()
    assert keep.finish_reason is FinishReason.LENGTH
    assert worker.cache.pool.num_free == 64
