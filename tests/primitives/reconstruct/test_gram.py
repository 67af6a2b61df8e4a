"""primitives/reconstruct/gram.py: streamed Gram, cross-Gram and mean statistics, the bias column, the hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimkit.primitives.reconstruct import (
    CrossGramAccumulator,
    GramStatistics,
    MeanAccumulator,
    gram_hooks,
    with_bias_column,
)
from tests.primitives.reconstruct.activations import inputs


def test_gram_statistics_streams_batches_of_any_shape_and_dtype() -> None:
    x = inputs(40, 6)
    stats = GramStatistics(6)
    stats.update(x[:10].reshape(2, 5, 6))
    stats.update(x[10:].float().reshape(3, 10, 6))
    assert stats.tokens == 40
    assert stats.gram.dtype == torch.float64 and stats.sum.dtype == torch.float64
    torch.testing.assert_close(stats.gram, x.T @ x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.mean(), x.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.second_moment(), x.T @ x / 40, rtol=1e-6, atol=1e-6)

    capped = GramStatistics(6, max_tokens=15)
    for chunk in x.split(10):
        capped.update(chunk.bfloat16())
    xb = x[:15].bfloat16().double()
    assert capped.tokens == 15 and capped.full
    torch.testing.assert_close(capped.gram, xb.T @ xb)
    torch.testing.assert_close(capped.sum, xb.sum(0))
    with pytest.raises(ValueError):
        stats.update(torch.zeros(3, 5))
    with pytest.raises(RuntimeError):
        MeanAccumulator(3).mean()


def test_cross_gram_matches_explicit_product() -> None:
    a, b = inputs(30, 5, seed=1), inputs(30, 3, seed=2)
    cross = CrossGramAccumulator(5, 3)
    cross.update(a[:12].reshape(3, 4, 5), b[:12].reshape(3, 4, 3))
    cross.update(a[12:], b[12:])
    assert cross.tokens == 30
    torch.testing.assert_close(cross.cross, a.T @ b)
    with pytest.raises(ValueError):
        cross.update(a[:4], b[:5])


def test_gram_hooks_capture_module_inputs() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3))
    x = torch.randn(2, 9, 4)
    with gram_hooks({"up": block[0], "down": block[2]}) as stats:
        block(x)
    hidden = torch.relu(block[0](x)).detach().reshape(-1, 7).double()
    assert stats["down"].tokens == 18
    torch.testing.assert_close(stats["down"].gram, hidden.T @ hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats["up"].sum, x.reshape(-1, 4).double().sum(0), rtol=1e-6, atol=1e-6)
    block(x)  # hooks are gone after the block
    assert stats["down"].tokens == 18


def test_with_bias_column_is_the_gram_of_x_and_one() -> None:
    x = inputs(20, 4, seed=3)
    stats = GramStatistics(4)
    stats.update(x)
    augmented = torch.cat([x, torch.ones(20, 1, dtype=x.dtype)], dim=1)
    torch.testing.assert_close(with_bias_column(stats.gram, stats.sum, stats.tokens), augmented.T @ augmented)
