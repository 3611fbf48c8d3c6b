"""A Hugging Face-style model directory written offline: a small byte-level BPE tokenizer
(``tokenizer.json``, ``tokenizer_config.json`` with an optional chat template) and, for
``kvmove-serve --model DIR``, the tiny preset's random weights beside it."""

from __future__ import annotations

import json
import os

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the kv cache moves fast between prefill and decode workers",
          "user: hello there, assistant: hi! how can I help you today?",
          "system: you are terse. héllo wörld ✓ 日本語 🦙"] * 20


def write_bpe_tokenizer(path: str, chat_template: str | list[dict] | None = None,
                        vocab_size: int = 300) -> None:
    """A byte-level BPE (every byte has a token: no unknown text) of ``vocab_size`` ids,
    trained on ``CORPUS``; BOS ``<s>``, EOS ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_checkpoint(path: str, chat_template: str | None = None) -> None:
    """The tiny preset with seed 0's weights (what ``--model tiny`` builds), saved as a
    checkpoint, with ``write_bpe_tokenizer``'s tokenizer."""
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM

    LlamaForCausalLM.random(MODEL_PRESETS["tiny"], seed=0).save_pretrained(path)
    write_bpe_tokenizer(path, chat_template)
