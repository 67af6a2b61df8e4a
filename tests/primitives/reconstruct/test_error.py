"""primitives/reconstruct/error.py: output errors from a Gram matrix and the column helpers."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.reconstruct import (
    embed_columns,
    kept_columns,
    output_energy,
    output_error,
)
from tests.primitives.reconstruct.activations import gen, inputs


def test_output_error_and_column_helpers() -> None:
    x = inputs(30, 4, seed=60)
    w = torch.randn(2, 4, generator=gen(61), dtype=torch.float64)
    approx = torch.randn(2, 4, generator=gen(62), dtype=torch.float64)
    explicit = float((x @ (w - approx).T).pow(2).sum())
    assert output_error(w, approx, x.T @ x) == pytest.approx(explicit)
    assert output_error(w, approx, x.T @ x, relative=True) == pytest.approx(explicit / float((x @ w.T).pow(2).sum()))
    assert kept_columns(5, [1, 3]).tolist() == [0, 2, 4]
    embedded = embed_columns(torch.ones(2, 2), [3, 0], 4)
    assert embedded.tolist() == [[1, 0, 0, 1], [1, 0, 0, 1]]
    with pytest.raises(ValueError):
        kept_columns(3, [3])
    with pytest.raises(ValueError):
        embed_columns(torch.ones(2, 2), [0, 0], 4)


def test_output_error_on_the_changed_columns_equals_the_full_product():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(5, 9, generator=g, dtype=torch.float64)
    x = torch.randn(40, 9, generator=g, dtype=torch.float64)
    gram = x.T @ x
    removed = w.clone()
    removed[:, [1, 4, 7]] = 0.0  # a removal without a refit: only three columns differ
    for approx in (removed, removed + 0.01 * torch.randn(5, 9, generator=g, dtype=torch.float64), w):
        expected = float(((w - approx) @ x.T).square().sum())  # ||(W - Ŵ) X||² by hand
        assert output_error(w, approx, gram) == pytest.approx(expected, rel=1e-10, abs=1e-12)
        energy = float((w @ x.T).square().sum())
        assert output_energy(w, gram) == pytest.approx(energy, rel=1e-10)
        assert output_error(w, approx, gram, relative=True, energy=output_energy(w, gram)) == pytest.approx(
            expected / energy, rel=1e-10, abs=1e-12
        )
