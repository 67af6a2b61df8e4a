"""primitives/evaluate/llamacpp.py: perplexity from llama.cpp's logits (the GGUF runs themselves are checked in
tests/primitives/export, where llama-cpp-python is installed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slimkit.primitives.evaluate.llamacpp import nll_perplexity


def test_uniform_logits_give_the_vocabulary_size() -> None:
    logits = np.zeros((6, 11), dtype=np.float32)
    assert nll_perplexity(logits, [1, 2, 3, 4, 5, 6]) == pytest.approx(11.0)


def test_perplexity_reads_the_next_token_under_each_row() -> None:
    # Row t predicts token t + 1: p(ids[1]) = 1/2 under row 0, p(ids[2]) = 1/4 under row 1; row 2 is unused.
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25], [1.0, 1.0, 1.0]]))
    expected = math.exp(-(math.log(0.5) + math.log(0.25)) / 2)
    assert nll_perplexity(logits, torch.tensor([0, 1, 2])) == pytest.approx(expected)
    assert nll_perplexity(logits.numpy(), [0, 1, 2]) == pytest.approx(expected)
