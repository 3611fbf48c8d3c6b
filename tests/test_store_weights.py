"""Stored KV belongs to the weights that computed it (``KVStore(weights=)``,
``kvmove/engine/weights_id.py``).

Issue 28, row 7: new weights saved to the same ``--model`` directory, a worker restarted on
the same ``--store-dir``: the store, named after the path alone, served 128 prompt tokens' KV
of the old weights and the output changed. Here the worker's own ``load_model`` and
``_open_store`` (what ``kvmove-serve``'s workers run) over a real checkpoint directory saved
over with safetensors, and a real disk tier: the new weights' run loads nothing and its tokens
are those of the new weights with no store.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_store import LAYOUT, disk, hashes_for, put, random_cache

from kvmove import KVStore
from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import Request, SamplingParams
from kvmove.engine.weights_id import weights_id
from kvmove.engine.worker import EngineWorker
from kvmove.errors import StoreError
from kvmove.serve.worker_main import _open_store, _parser, load_model

TINY = MODEL_PRESETS["tiny"]
PROMPT = [(7 * i) % 250 + 1 for i in range(129)]  # 128 tokens' KV in full blocks, as reported
MAX_TOKENS = 8


def run(model: LlamaForCausalLM, store: KVStore | None) -> Request:
    """The prompt through a fresh colocated worker (an empty live cache)."""
    worker = EngineWorker(model, num_blocks=64, block_size=16, store=store)
    request = Request("r", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    worker.add_request(request)
    worker.run()
    worker.close()  # waits for the store's copies of the finished request's blocks
    return request


# --- the identity ------------------------------------------------------------------------


def test_the_same_weights_loaded_again_have_the_same_id(tmp_path):
    model = LlamaForCausalLM.random(TINY, seed=0)
    model.save_pretrained(str(tmp_path))
    assert weights_id(LlamaForCausalLM.from_pretrained(str(tmp_path))) == weights_id(model)
    assert weights_id(LlamaForCausalLM.random(TINY, seed=0)) == weights_id(model)


def test_other_weights_or_config_have_another_id():
    model = LlamaForCausalLM.random(TINY, seed=0)
    ids = {weights_id(model), weights_id(LlamaForCausalLM.random(TINY, seed=1))}
    tuned = LlamaForCausalLM.random(TINY, seed=0)
    with torch.no_grad():  # a fine-tune of one tensor, in the middle of the state dict
        tuned.model.layers[1].self_attn.v_proj.weight.add_(1e-3)
    ids.add(weights_id(tuned))
    same_weights = LlamaForCausalLM(replace(TINY, rope_theta=TINY.rope_theta * 2))
    same_weights.load_state_dict(model.state_dict())
    ids.add(weights_id(same_weights))  # the same tensors, another rope: other KV
    assert len(ids) == 4


# --- the store ---------------------------------------------------------------------------


def test_a_disk_tier_of_other_weights_is_emptied_and_its_slots_reused(tmp_path):
    src = random_cache(LAYOUT, 8)
    old, new = hashes_for(8, seed=1), hashes_for(8, seed=2)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m", weights="a") as store:
        assert put(store, old, src, list(range(8))) == 8
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m", weights="b") as store:
        assert store.lookup(old).num_blocks == 0
        assert store.stats().blocks["disk"] == 0
        assert put(store, new, src, list(range(8))) == 8  # every slot free again
        assert store.stats().tiers["disk"].evicted == 0
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m", weights="b") as store:
        assert store.lookup(new).num_blocks == 8  # the same weights again: kept
        assert store.lookup(old).num_blocks == 0


def test_a_disk_tier_of_weights_not_said_is_emptied(tmp_path):
    """A tier written before weights were said (kvmove-serve before issue 28): whatever
    computed it is unknown, so nothing of it is served."""
    src = random_cache(LAYOUT, 4)
    hashes = hashes_for(4)
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m") as store:
        put(store, hashes, src, [0, 1, 2, 3])
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m", weights="a") as store:
        assert store.lookup(hashes).num_blocks == 0


def test_another_namespace_is_still_refused_whatever_the_weights(tmp_path):
    with KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="m", weights="a"):
        pass
    with pytest.raises(StoreError, match="another layout"):
        KVStore(LAYOUT, [disk(tmp_path, LAYOUT, 8)], namespace="n", weights="a")


# --- the worker: issue 28's row 7 --------------------------------------------------------


def test_new_weights_saved_over_the_model_path_get_none_of_the_old_kv(tmp_path):
    checkpoint, store_dir = tmp_path / "model", tmp_path / "store"
    args = _parser().parse_args([
        "--name", "prefill-0", "--role", "colocated", "--router", "ipc://unused",
        "--model", str(checkpoint), "--store-dir", str(store_dir), "--store-disk-gb", "0.01"])
    LlamaForCausalLM.random(TINY, seed=0).save_pretrained(str(checkpoint))
    old, _ = load_model(args.model)
    with _open_store(args, old) as store:
        run(old, store)
        assert store.stats().blocks["disk"] == len(PROMPT) // 16
    with _open_store(args, old) as store:  # the same weights: served, as before
        assert run(old, store).num_stored == 128

    LlamaForCausalLM.random(TINY, seed=1).save_pretrained(str(checkpoint))  # saved over
    new, _ = load_model(args.model)
    expected = run(new, None).output
    with _open_store(args, new) as store:
        request = run(new, store)
    assert request.num_stored == 0
    assert request.output == expected
