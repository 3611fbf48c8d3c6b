"""The engine's Llama against transformers' on the same checkpoint, the paged KV cache's
properties, the checkpoint loader, and the tokenizers.

Reference: every checkpoint is written here (``LlamaForCausalLM.random`` + ``save_pretrained``
into ``tmp_path``) and loaded by ``transformers.LlamaForCausalLM.from_pretrained`` in float32;
nothing is downloaded. Tolerance: logits and K/V agree within atol = rtol = 1e-5 (float32;
the two implementations order their sums differently: observed differences are under 1e-6,
and every greedy choice here wins by at least 1e-4), and greedy tokens are equal, for 16
generated tokens after each of several prompts.

Paged-cache properties compare the model with itself: a prefill in chunks, a batch, a
scattered block table or another block size must give what one sequence, in one piece, in
consecutive blocks gives (atol 1e-5: a different split changes matmul shapes, hence rounding).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import kvmove
from kvmove import KVSpec
from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM, ModelConfig, SeqChunk
from kvmove.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kvmove.errors import ConfigError

ATOL = RTOL = 1e-5
STEPS = 16
BOS = 256

# hidden 64, 2-3 layers: the whole file runs in seconds.
CONFIGS = {
    "gqa": ModelConfig(num_heads=4, num_kv_heads=2),
    "mha": ModelConfig(num_heads=4, num_kv_heads=4),
    "mqa": ModelConfig(num_layers=3, num_heads=4, num_kv_heads=1),
    "tied": ModelConfig(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    # head_dim 8 != 64 / 4; non-default rope_theta and eps check config.json's mapping too.
    "head-dim-8": ModelConfig(num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500000.0,
                              rms_norm_eps=1e-6),
}
PROMPTS = [
    [BOS],
    ByteTokenizer().encode("Hello, paged world!"),
    [BOS, *random.Random(7).choices(range(320), k=40)],
]


def _cache(config: ModelConfig, block_size: int = 4, num_blocks: int | None = None) -> torch.Tensor:
    """A fresh (zeroed) cache view; by default room for 128 positions."""
    num_blocks = 128 // block_size if num_blocks is None else num_blocks
    return kvmove.KVCache(config.kv_spec(block_size), num_blocks).torch()


def _context(kv: torch.Tensor, layer: int, table: list[int], num_tokens: int) -> torch.Tensor:
    """K and V of the first ``num_tokens`` positions through ``table``: ``[2, T, H, D]``."""
    blocks = kv[layer, table]  # [n, 2, B, H, D]
    return blocks.transpose(0, 1).reshape(2, -1, *kv.shape[4:])[:, :num_tokens]


def _greedy(model: LlamaForCausalLM, prompt: list[int], steps: int = STEPS,
            block_size: int = 4) -> tuple[list[int], torch.Tensor]:
    """kvmove greedy: prefill, then one token per forward. Returns the generated tokens and
    the logits that chose them, ``[steps, vocab]``."""
    kv = _cache(model.config, block_size)
    table = list(range(kv.shape[1]))
    logits = [model([SeqChunk(prompt, 0, table)], kv)[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        position = len(prompt) + len(tokens) - 1
        logits.append(model([SeqChunk([tokens[-1]], position, table)], kv)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@torch.no_grad()
def _hf_greedy(hf: torch.nn.Module, prompt: list[int],
               steps: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """transformers greedy without a cache: the whole sequence every step."""
    sequence, logits = list(prompt), []
    for _ in range(steps):
        logits.append(hf(torch.tensor([sequence]), use_cache=False).logits[0, -1].float())
        sequence.append(int(logits[-1].argmax()))
    return sequence[len(prompt):], torch.stack(logits)


def _hf_layer_kv(out: object, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cached K, V from a transformers output, ``[H, T, D]`` each."""
    cache = out.get("cache")  # transformers 5.2x; older versions: past_key_values
    if cache is None:
        cache = out.get("past_key_values")
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys[0], cache.layers[layer].values[0]
    keys, values = cache[layer][:2]
    return keys[0], values[0]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory, transformers):
    """(kvmove model, transformers model) loaded from one checkpoint written here."""
    config = CONFIGS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    LlamaForCausalLM.random(config, seed=1).save_pretrained(path)
    ours = LlamaForCausalLM.from_pretrained(path)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=3)


# --- against transformers ----------------------------------------------------------------


def test_reference_config_is_what_was_asked(pair, request):
    ours, hf = pair
    c, h = ours.config, hf.config
    assert c == CONFIGS[request.node.callspec.params["pair"]]
    rope = getattr(h, "rope_parameters", None) or {}  # transformers 5; 4.x: h.rope_theta
    assert (rope.get("rope_theta") or h.rope_theta, h.rms_norm_eps) == (c.rope_theta,
                                                                         c.rms_norm_eps)
    assert (h.num_attention_heads, h.num_key_value_heads, h.head_dim) == \
        (c.num_heads, c.num_kv_heads, c.head_dim)
    assert h.tie_word_embeddings == c.tie_word_embeddings
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == \
        c.tie_word_embeddings


@pytest.mark.parametrize("prompt", PROMPTS, ids=["bos", "text", "41-tokens"])
def test_greedy_tokens_and_logits_match_transformers(pair, prompt):
    ours, hf = pair
    tokens, logits = _greedy(ours, prompt)
    hf_tokens, hf_logits = _hf_greedy(hf, prompt)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=RTOL)
    assert tokens == hf_tokens


@torch.no_grad()
def test_cached_kv_equals_transformers_past_key_values(pair):
    ours, hf = pair
    prompt = PROMPTS[2]
    kv = _cache(ours.config, block_size=4, num_blocks=32)
    table = random.Random(0).sample(range(32), 11)  # 41 tokens, scattered blocks
    ours([SeqChunk(prompt, 0, table)], kv)
    out = hf(torch.tensor([prompt]), use_cache=True)
    for layer in range(ours.config.num_layers):
        keys, values = _context(kv, layer, table, len(prompt))
        hf_keys, hf_values = _hf_layer_kv(out, layer)
        torch.testing.assert_close(keys, hf_keys.transpose(0, 1), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(values, hf_values.transpose(0, 1), atol=ATOL, rtol=RTOL)


def test_loads_a_checkpoint_transformers_wrote(tmp_path, transformers):
    hf_config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=257)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(str(tmp_path))
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path))
    prompt = PROMPTS[2]
    _, logits = _greedy(ours, prompt, steps=4)
    _, hf_logits = _hf_greedy(hf, prompt, steps=4)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=RTOL)


def test_loads_rope_theta_from_rope_parameters(tmp_path, transformers):
    hf_config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=257,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    transformers.LlamaForCausalLM(hf_config).save_pretrained(str(tmp_path))
    assert LlamaForCausalLM.from_pretrained(str(tmp_path)).config.rope_theta == 500000.0


def test_rejects_scaled_rope_in_rope_parameters(tmp_path):
    _write_checkpoint(tmp_path, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    with pytest.raises(ConfigError, match="rope"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


# --- paged cache properties --------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cuts", [[1], [5, 6], [16, 17, 30], list(range(1, 41))],
                         ids=["1+40", "5+1+35", "16+1+13+11", "one-by-one"])
def test_chunked_prefill_equals_one_shot(tiny, block_size, cuts):
    prompt = PROMPTS[2]
    whole_kv, chunked_kv = _cache(tiny.config, block_size), _cache(tiny.config, block_size)
    table = list(range(whole_kv.shape[1]))[: -(-len(prompt) // block_size)]
    whole = tiny([SeqChunk(prompt, 0, table)], whole_kv)
    for start, stop in zip([0, *cuts], [*cuts, len(prompt)]):
        last = tiny([SeqChunk(prompt[start:stop], start, table)], chunked_kv)
    torch.testing.assert_close(last, whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(chunked_kv, whole_kv, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batch_of_mixed_lengths_equals_each_alone(tiny, block_size):
    """Prefills of 1, 7 and 41 tokens and a decode step (position 20) in one forward."""
    chunks = [(PROMPTS[0], 0), (PROMPTS[2][:7], 0), (PROMPTS[2], 0), ([65], 20)]
    history = PROMPTS[1][:20]  # what the decoding sequence's cache holds first
    per_seq = 64 // block_size
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(chunks))]
    batched_kv = _cache(tiny.config, block_size, num_blocks=len(chunks) * per_seq)
    tiny([SeqChunk(history, 0, tables[3])], batched_kv)
    batched = tiny([SeqChunk(t, s, tab) for (t, s), tab in zip(chunks, tables)], batched_kv)
    for i, ((tokens, start), table) in enumerate(zip(chunks, tables)):
        alone_kv = _cache(tiny.config, block_size, num_blocks=len(chunks) * per_seq)
        if start:
            tiny([SeqChunk(history, 0, table)], alone_kv)
        alone = tiny([SeqChunk(tokens, start, table)], alone_kv)
        torch.testing.assert_close(batched[i], alone[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(batched_kv[:, table], alone_kv[:, table], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_scattered_block_table_equals_contiguous(tiny, block_size):
    prompt, num_blocks = PROMPTS[2], 128 // block_size
    needed = -(-(len(prompt) + 3) // block_size)
    contiguous = list(range(needed))
    scattered = random.Random(block_size).sample(range(num_blocks), needed)
    assert scattered != sorted(scattered)
    results = []
    for table in (contiguous, scattered):
        kv = _cache(tiny.config, block_size, num_blocks)
        logits = [tiny([SeqChunk(prompt, 0, table)], kv)]
        for step, token in enumerate([5, 300, 7]):  # and three decode steps
            logits.append(tiny([SeqChunk([token], len(prompt) + step, table)], kv))
        contexts = [_context(kv, layer, table, len(prompt) + 3)
                    for layer in range(tiny.config.num_layers)]
        results.append((torch.cat(logits), torch.stack(contexts)))
    torch.testing.assert_close(results[1], results[0], atol=ATOL, rtol=RTOL)


def test_block_sizes_agree(tiny):
    prompt = PROMPTS[2]
    out = {}
    for block_size in (1, 4, 16):
        kv = _cache(tiny.config, block_size, num_blocks=64 // block_size)
        table = list(range(kv.shape[1]))
        logits = tiny([SeqChunk(prompt, 0, table)], kv)
        out[block_size] = (logits, _context(kv, 1, table, len(prompt)))
    torch.testing.assert_close(out[1], out[4], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[16], out[4], atol=ATOL, rtol=RTOL)


def test_forward_writes_only_its_own_positions(tiny):
    kv = _cache(tiny.config, block_size=4, num_blocks=16)
    kv.fill_(7.0)
    tiny([SeqChunk(PROMPTS[1][:6], 3, [9, 2, 5])], kv)  # positions 3..8: blocks 9, 2, 5
    written = torch.zeros(kv.shape[1], kv.shape[3], dtype=torch.bool)
    written[9, 3] = written[2, :] = written[5, 0] = True
    untouched = kv.permute(1, 3, 0, 2, 4, 5)[~written]
    assert torch.all(untouched == 7.0)
    assert not torch.any(kv.permute(1, 3, 0, 2, 4, 5)[written] == 7.0)


# --- layer_hook ---------------------------------------------------------------------------


def test_layer_hook_runs_in_order_once_each_layers_kv_is_in_place():
    config = CONFIGS["mqa"]  # 3 layers
    model = LlamaForCausalLM.random(config, seed=5)
    kv = _cache(config, block_size=4, num_blocks=32)
    seqs = [SeqChunk(PROMPTS[1], 0, [0, 1, 2, 3, 4]), SeqChunk(PROMPTS[2], 0, list(range(8, 19)))]
    calls, snapshots = [], []

    def hook(layer: int) -> None:
        calls.append(layer)
        snapshots.append(kv.clone())

    model(seqs, kv, layer_hook=hook)
    assert calls == [0, 1, 2]
    for layer, snapshot in enumerate(snapshots):
        # layer `layer` is complete for every sequence, later layers untouched (zero)
        assert torch.equal(snapshot[: layer + 1], kv[: layer + 1])
        assert not snapshot[layer + 1:].any()
    for seq in seqs:
        assert _context(kv, 2, list(seq.block_table), len(seq.tokens)).abs().sum() > 0


def test_no_hook_is_fine_and_hook_does_not_change_results(tiny):
    kv_a, kv_b = _cache(tiny.config), _cache(tiny.config)
    a = tiny([SeqChunk(PROMPTS[2], 0, list(range(11)))], kv_a)
    b = tiny([SeqChunk(PROMPTS[2], 0, list(range(11)))], kv_b, layer_hook=lambda layer: None)
    assert torch.equal(a, b) and torch.equal(kv_a, kv_b)


# --- loader -------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_load_round_trip_is_exact(tmp_path, tied):
    config = ModelConfig(num_kv_heads=1, head_dim=8, tie_word_embeddings=tied, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=300,
                         eos_token_id=301)
    model = LlamaForCausalLM.random(config, seed=11)
    model.save_pretrained(str(tmp_path))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.config == config
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded_state[name], tensor), name
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tied
    kv_a, kv_b = _cache(config), _cache(config)
    seq = SeqChunk(PROMPTS[2], 0, list(range(11)))
    assert torch.equal(model([seq], kv_a), loaded([seq], kv_b))


def test_random_is_deterministic_per_seed():
    config = MODEL_PRESETS["tiny"]
    a, b, c = (LlamaForCausalLM.random(config, seed) for seed in (1, 1, 2))
    assert torch.equal(a.model.layers[1].mlp.up_proj.weight, b.model.layers[1].mlp.up_proj.weight)
    assert not torch.equal(a.model.layers[1].mlp.up_proj.weight,
                           c.model.layers[1].mlp.up_proj.weight)


def _write_checkpoint(path, **config_overrides) -> None:
    """A valid tiny checkpoint at ``path`` with ``config.json`` entries replaced."""
    LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0).save_pretrained(str(path))
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, **config_overrides}, f)


def _edit_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    edit(state)
    save_file(state, file)


def test_load_rejects_missing_config(tmp_path):
    _write_checkpoint(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no config.json"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


def test_load_rejects_missing_weights(tmp_path):
    _write_checkpoint(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="no .*safetensors"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


def test_load_rejects_missing_tensor(tmp_path):
    _write_checkpoint(tmp_path)
    _edit_weights(tmp_path, lambda state: state.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing \['model.layers.1.self_attn.k_proj.weight'"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


def test_null_config_entries_take_the_defaults(tmp_path):
    """Real configs carry ``"head_dim": null`` and the like: null means the default."""
    _write_checkpoint(tmp_path, head_dim=None, rope_theta=None, eos_token_id=None)
    config = LlamaForCausalLM.from_pretrained(str(tmp_path)).config
    assert config.head_dim == config.hidden_size // config.num_heads
    assert config.rope_theta == 10000.0 and config.eos_token_id == 257


def test_load_rejects_unexpected_tensor(tmp_path):
    _write_checkpoint(tmp_path)
    _edit_weights(tmp_path, lambda state: state.update(
        {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ConfigError, match="unexpected .*q_proj.bias"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


def test_load_rejects_wrong_shape(tmp_path):
    _write_checkpoint(tmp_path)
    _edit_weights(tmp_path, lambda state: state.update(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(ConfigError, match="up_proj"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(("overrides", "match"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"num_key_value_heads": 3}, "num_kv_heads 3 must divide num_heads 4"),
    ({"eos_token_id": 320}, "eos_token_id 320 is outside the vocabulary"),
], ids=["rope-scaling", "model-type", "kv-heads", "eos-outside-vocab"])
def test_load_rejects_unsupported_config(tmp_path, overrides, match):
    _write_checkpoint(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=match):
        LlamaForCausalLM.from_pretrained(str(tmp_path))


# --- forward input checks -----------------------------------------------------------------


@pytest.mark.parametrize(("seqs", "match"), [
    ([SeqChunk([1, 320], 0, [0])], r"token ids must be in \[0, 320\)"),
    ([SeqChunk([-1], 0, [0])], r"token ids must be in \[0, 320\)"),
    ([SeqChunk(list(range(9)), 0, [0, 1])], "needs 3 blocks for 9 positions, its block table "
                                            "has 2"),
    ([SeqChunk([1], 8, [0, 1])], "needs 3 blocks for 9 positions"),
    ([SeqChunk([1, 2], 0, [8])], r"outside \[0, 8\)"),
    ([SeqChunk([1, 2], 0, [-1])], r"outside \[0, 8\)"),
    ([SeqChunk([1], 0, [0]), SeqChunk([], 0, [1])], "sequence 1 has no new tokens"),
    ([SeqChunk([1], 4096, list(range(8)))], "the model has 4096"),
    ([], "at least one sequence"),
], ids=["token-id-vocab", "token-id-negative", "table-short", "table-short-decode",
        "block-id-high", "block-id-negative", "empty-chunk", "past-max-positions", "no-seqs"])
def test_forward_rejects_bad_inputs_and_writes_nothing(tiny, seqs, match):
    kv = _cache(tiny.config, block_size=4, num_blocks=8)
    with pytest.raises(ConfigError, match=match):
        tiny(seqs, kv)
    assert not kv.any()


@pytest.mark.parametrize("shape", [(3, 8, 2, 4, 2, 16), (2, 8, 2, 4, 1, 16), (2, 8, 2, 4, 2, 8),
                                   (2, 8, 4, 2, 16)],
                         ids=["layers", "kv-heads", "head-dim", "five-dims"])
def test_forward_rejects_kv_of_wrong_shape(tiny, shape):
    with pytest.raises(ConfigError, match="does not fit the model"):
        tiny([SeqChunk([1], 0, [0])], torch.zeros(shape))


def test_forward_rejects_kv_of_wrong_dtype(tiny):
    layout = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=4)
    kv = kvmove.KVCache(layout, 8).torch()
    with pytest.raises(ConfigError, match=r"torch.float16.*want .* in float32"):
        tiny([SeqChunk([1], 0, [0])], kv)


# --- tokenizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["hello, world", "ünïcödé", "日本語の文", "🦙 + 🔑 = 🚀", ""],
                         ids=["ascii", "latin", "cjk", "emoji", "empty"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == BOS and ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id, 300]) == text  # specials and ids > 255 skipped


def test_byte_tokenizer_truncated_multibyte_decodes_to_replacement():
    ids = ByteTokenizer().encode("a🦙", add_bos=False)  # 'a' + 4 bytes
    assert ByteTokenizer().decode(ids[:3]) == "a\ufffd"
    assert ByteTokenizer().decode([0xFF, 0xC3]) == "\ufffd\ufffd"


def test_byte_tokenizer_ids_and_rejections():
    tok = ByteTokenizer(bos_token_id=300, eos_token_id=258)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (300, 258, 301)
    assert ByteTokenizer().vocab_size == 258
    with pytest.raises(ConfigError, match="bos_token_id must be an int >= 256.*got 1"):
        ByteTokenizer(bos_token_id=1)
    with pytest.raises(ConfigError, match="token ids must be >= 0, got -3"):
        tok.decode([65, -3])


def test_load_tokenizer_without_tokenizer_json_gives_bytes(tmp_path):
    config = ModelConfig(vocab_size=300, bos_token_id=290, eos_token_id=291)
    for path in (None, str(tmp_path)):
        tok = load_tokenizer(path, config)
        assert isinstance(tok, ByteTokenizer)
        assert (tok.bos_token_id, tok.eos_token_id) == (290, 291)


def test_load_tokenizer_rejects_byte_fallback_when_special_ids_are_bytes(tmp_path):
    config = ModelConfig(vocab_size=300, bos_token_id=299, eos_token_id=1)
    with pytest.raises(ConfigError, match="no tokenizer.json.*eos_token_id must be an int >= 256"):
        load_tokenizer(str(tmp_path), config)


WORDS = ["[UNK]", "<s>", "</s>", "the", "kv", "cache", "moves", "fast", "!"]


def _write_hf_tokenizer(path, words=WORDS, tokenizer_config: dict | None = None) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(cleanup=False)  # joins words with spaces
    tok.add_special_tokens(["<s>", "</s>"])
    # a template that adds BOS itself: HFTokenizer must not double it
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    if tokenizer_config is not None:
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)


def test_hf_tokenizer_round_trip(tmp_path):
    _write_hf_tokenizer(tmp_path, tokenizer_config={"bos_token": "<s>",
                                                    "eos_token": {"content": "</s>"}})
    tok = load_tokenizer(str(tmp_path), MODEL_PRESETS["tiny"])
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, len(WORDS))
    ids = tok.encode("the kv cache moves fast !")
    assert ids == [1, 3, 4, 5, 6, 7, 8]
    assert tok.encode("the kv", add_bos=False) == [3, 4]
    assert tok.decode([*ids, 2]) == "the kv cache moves fast !"
    assert tok.encode("the unknown") == [1, 3, 0]


def test_hf_tokenizer_special_ids_fall_back_to_config_json_then_model(tmp_path):
    _write_hf_tokenizer(tmp_path)  # no tokenizer_config.json
    tok = load_tokenizer(str(tmp_path), ModelConfig(bos_token_id=5, eos_token_id=6))
    assert (tok.bos_token_id, tok.eos_token_id) == (5, 6)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 8]}, f)
    tok = load_tokenizer(str(tmp_path), ModelConfig(bos_token_id=5, eos_token_id=6))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_hf_tokenizer_rejects_unknown_special_token(tmp_path):
    _write_hf_tokenizer(tmp_path, tokenizer_config={"bos_token": "<|begin|>"})
    with pytest.raises(ConfigError, match="bos_token '<|begin|>'.*not in tokenizer.json"):
        HFTokenizer(str(tmp_path))


def test_load_tokenizer_rejects_vocab_larger_than_model(tmp_path):
    words = [*WORDS, *(f"w{i}" for i in range(400))]  # 409 ids
    _write_hf_tokenizer(tmp_path, words=words, tokenizer_config={"bos_token": "<s>",
                                                                 "eos_token": "</s>"})
    with pytest.raises(ConfigError, match="needs a vocabulary of 409 ids, the model has 320"):
        load_tokenizer(str(tmp_path), MODEL_PRESETS["tiny"])


def test_hf_tokenizer_rejects_missing_or_bad_file(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(ConfigError, match="no tokenizer file"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        HFTokenizer(str(tmp_path))


def test_hf_tokenizer_without_tokenizers_library_says_how_to_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes the import fail
    with pytest.raises(ConfigError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path), MODEL_PRESETS["tiny"])
