"""primitives/evaluate/perplexity.py: evaluation windows, perplexity of windows and of a corpus."""

from __future__ import annotations

import math

import pytest
import torch

from slimkit.primitives.evaluate.perplexity import perplexity, perplexity_of_windows, windows_of


def test_windows_are_non_overlapping_and_budgeted():
    ids = torch.arange(25)
    w = windows_of(ids, 10, None)
    assert w.tolist() == [list(range(10)), list(range(10, 20))]
    assert windows_of(ids, 5, 12).shape == (2, 5)


def test_uniform_model_has_vocab_perplexity():
    class Uniform(torch.nn.Module):
        def forward(self, ids, use_cache=False):
            return type("O", (), {"logits": torch.zeros(*ids.shape, 7)})()

    windows = torch.randint(0, 7, (3, 6))
    assert perplexity_of_windows(Uniform(), windows, batch_size=2) == pytest.approx(7.0)


def test_perplexity_on_tiny_llama(tokenizer):
    from tests.tiny import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer))
    result = perplexity(model, tokenizer, "wikitext2", seq_len=32, max_tokens=100)
    assert (result.windows, result.seq_len, result.tokens) == (3, 32, 96)
    assert math.isfinite(result.perplexity) and result.perplexity > 1


def test_chunked_head_equals_full_logits(tokenizer):
    from torch.nn import functional as F

    from tests.tiny import tiny_llama, tiny_opt

    windows = torch.randint(3, 250, (3, 20))
    for model in (tiny_llama(vocab_size=len(tokenizer)), tiny_opt(vocab_size=len(tokenizer))):
        with torch.no_grad():
            logits = model(windows).logits[:, :-1]
        expected = math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item())
        got = perplexity_of_windows(model, windows, batch_size=2, chunk_tokens=7)
        assert got == pytest.approx(expected, rel=1e-5)
