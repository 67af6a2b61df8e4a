"""Tiny random causal LMs of families slimkit evaluates and inspects but has no compression adapter for.

Built from transformers' own config classes, offline, in milliseconds; each is saved with the byte tokenizer as a
plain Hugging Face folder, as a user would bring it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

FOREIGN_CONFIGS: dict[str, dict[str, object]] = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_neox": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
    },
    "phi": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
    },
    "falcon": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128},
}
"""Per ``model_type``, the widths of a two-layer model with hidden size 32 and 4 heads."""


def tiny_foreign(model_type: str, vocab_size: int) -> torch.nn.Module:
    """A randomly initialised two-layer causal LM of ``model_type`` (a key of :data:`FOREIGN_CONFIGS`)."""
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **FOREIGN_CONFIGS[model_type])
    return AutoModelForCausalLM.from_config(config).eval()


def saved_tiny_foreign(model_type: str, folder: Path, tokenizer: PreTrainedTokenizerFast) -> Path:
    """:func:`tiny_foreign` sized for ``tokenizer``, saved with it as a plain Hugging Face folder at ``folder``."""
    tiny_foreign(model_type, len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
