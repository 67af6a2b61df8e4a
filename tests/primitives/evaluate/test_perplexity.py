"""primitives/evaluate/perplexity.py: evaluation windows, perplexity of windows and of a corpus."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from slimkit.primitives.evaluate.perplexity import bos_prefix, perplexity, perplexity_of_windows, windows_of


def test_windows_are_non_overlapping_and_budgeted():
    ids = torch.arange(25)
    w = windows_of(ids, 10, None)
    assert w.tolist() == [list(range(10)), list(range(10, 20))]
    assert windows_of(ids, 5, 12).shape == (2, 5)


def test_windows_start_with_the_bos_a_tokenizer_adds():
    ids = torch.arange(10, 25)
    w = windows_of(ids, 5, None, bos=1)  # BOS, then 4 corpus tokens: 15 // 4 = 3 windows
    assert w.tolist() == [[1, 10, 11, 12, 13], [1, 14, 15, 16, 17], [1, 18, 19, 20, 21]]
    assert windows_of(ids, 5, 12, bos=1).shape == (2, 5)  # the budget counts the BOS too


def test_bos_prefix_only_for_tokenizers_that_add_one(tokenizer):
    from tokenizers import processors

    assert bos_prefix(tokenizer) is None  # the byte tokenizer adds nothing: windows as before
    adding = copy.deepcopy(tokenizer)
    bos = adding.bos_token_id
    adding.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert adding("ab").input_ids[0] == bos and bos_prefix(adding) == bos
    vocab = len(adding)
    result = perplexity(_Uniform(vocab), adding, "wikitext2", seq_len=8, max_tokens=32)
    assert (result.windows, result.tokens) == (4, 32) and result.perplexity == pytest.approx(vocab)


class _Uniform(torch.nn.Module):
    """Equal logits over ``vocab`` tokens: perplexity ``vocab`` on any window."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, ids, use_cache=False):
        assert (ids[:, 0] == 1).all() and ids[0, 1] != 1  # every window starts with the BOS, then the text
        return type("O", (), {"logits": torch.zeros(*ids.shape, self.vocab)})()


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


def test_a_model_without_an_adapter_is_scored_a_few_windows_at_a_time(tokenizer):
    from tests.tiny_foreign import tiny_foreign

    model = tiny_foreign("gpt2", len(tokenizer))  # no ModelView: its own forward, chunk_tokens // 16 = 1 window
    windows = torch.randint(0, len(tokenizer), (5, 16))
    with torch.no_grad():
        logits = model(windows).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    got = perplexity_of_windows(model, windows, batch_size=4, chunk_tokens=16)
    assert got == pytest.approx(nll.exp().item(), rel=1e-5)
