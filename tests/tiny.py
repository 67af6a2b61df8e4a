"""Tiny model and tokenizer factories for tests (random weights, built offline in milliseconds)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
)


def _randomise_norms(model: torch.nn.Module) -> torch.nn.Module:
    # Norm weights start at 1 (and biases at 0); random values make equality tests meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def tiny_llama(vocab_size: int = 300, layers: int = 3, tie: bool = True) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _randomise_norms(LlamaForCausalLM(config))


def tiny_opt(vocab_size: int = 300, layers: int = 2) -> OPTForCausalLM:
    config = OPTConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        ffn_dim=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return _randomise_norms(OPTForCausalLM(config))


def tiny_bert(vocab_size: int = 300, layers: int = 2) -> BertModel:
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    return _randomise_norms(BertModel(config))


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + specials), no training, no files."""
    byte_vocab = {ch: i + 3 for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **byte_vocab}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def model_output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One no-grad forward: the logits, or an encoder's last hidden state."""
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal within ``tol`` times the larger of 1 and ``expected``'s largest magnitude (no relative term)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol * max(scale, 1.0))
