"""primitives/reconstruct/lowrank_refit.py: the least-squares left factor of a low-rank pair."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.lowrank.svd import activation_weighted_svd, truncated_svd
from slimkit.primitives.reconstruct import (
    output_error,
    refit_left,
)
from tests.primitives.reconstruct.activations import gen, inputs, rel


def test_refit_left_is_exact_when_right_spans_the_row_space() -> None:
    x = inputs(100, 10, seed=25)
    g = gen(26)
    rows = torch.randn(3, 10, generator=g, dtype=torch.float64)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64) @ rows  # rank 3
    right = torch.randn(5, 5, generator=g, dtype=torch.float64) @ torch.cat(
        [rows, torch.randn(2, 10, generator=g, dtype=torch.float64)]
    )
    refit = refit_left(w, right, x.T @ x, damping=0.0)
    assert refit.weight.shape == (6, 5)
    assert rel(x @ (refit.weight @ right).T, x @ w.T) < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refit_left_is_never_worse_than_svd_on_the_calibration_gram(seed: int) -> None:
    x = inputs(200, 12, seed=30 + seed)
    w = torch.randn(8, 12, generator=gen(40 + seed), dtype=torch.float64)
    gram = x.T @ x
    norms = x.pow(2).sum(0).sqrt()
    for rank in (2, 5, 8):
        for left, right in (truncated_svd(w, rank), activation_weighted_svd(w, norms, rank)):
            refit = refit_left(w, right, gram, damping=0.0)
            floor = 1e-12 * output_error(w, torch.zeros_like(w), gram)  # rank 8 = d_out: both exact
            assert output_error(w, refit.weight @ right, gram) <= output_error(w, left @ right, gram) + floor


def test_refit_left_with_cross_fits_dense_outputs() -> None:
    dense = inputs(150, 7, seed=50)
    compressed = dense + 0.2 * torch.randn(150, 7, generator=gen(51), dtype=torch.float64)
    w = torch.randn(5, 7, generator=gen(52), dtype=torch.float64)
    _, right = truncated_svd(w, 3)
    refit = refit_left(w, right, compressed.T @ compressed, cross=dense.T @ compressed, damping=0.0)
    reference = torch.linalg.lstsq(compressed @ right.T, dense @ w.T).solution.T
    torch.testing.assert_close(refit.weight, reference, rtol=1e-9, atol=1e-9)
    cast = refit_left(w.float(), right.float(), compressed.T @ compressed)
    assert cast.weight.dtype == torch.float32
