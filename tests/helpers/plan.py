"""A Hugging Face ``config.json`` for the planner's tests (``--model PATH``)."""

from __future__ import annotations

import json
from pathlib import Path

# meta-llama/Llama-3.1-8B's config.json (transformers 4 spelling), as a user has it on disk.
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def write_config(folder: Path, config: dict) -> Path:
    """``folder/config.json`` holding ``config``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def write_llama_8b_config(folder: Path) -> Path:
    return write_config(folder, LLAMA_31_8B_CONFIG)
