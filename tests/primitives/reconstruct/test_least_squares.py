"""primitives/reconstruct/least_squares.py: least-squares refits of kept columns, to dense outputs, with a free bias."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.reconstruct import (
    CrossGramAccumulator,
    GramStatistics,
    bias_compensation,
    centred,
    embed_columns,
    kept_columns,
    output_error,
    refit_affine,
    refit_least_squares,
    refit_to_dense,
    with_bias_column,
)
from tests.primitives.reconstruct.activations import gen, inputs, rel


def test_refit_without_damping_is_the_exact_least_squares_solution() -> None:
    x = inputs(200, 8)
    w = torch.randn(5, 8, generator=gen(1), dtype=torch.float64)
    kept = [0, 2, 3, 5, 7]
    refit = refit_least_squares(w, x.T @ x, kept, damping=0.0)
    reference = torch.linalg.lstsq(x[:, kept], x @ w.T).solution.T
    assert refit.info.method == "cholesky" and refit.damping == 0.0
    torch.testing.assert_close(refit.weight, reference, rtol=1e-9, atol=1e-9)
    # never worse than keeping the columns as they are
    assert output_error(w, embed_columns(refit.weight, kept, 8), x.T @ x) <= output_error(
        w, embed_columns(w[:, kept], kept, 8), x.T @ x
    )


@pytest.mark.parametrize(("damping", "tolerance"), [(0.0, 1e-6), (1e-6, 1e-4)])  # the ridge biases by ~λ/σ_min
def test_removing_a_linearly_dependent_column_is_lossless(damping: float, tolerance: float) -> None:
    x = inputs(100, 6, seed=4)
    x[:, 3] = 2 * x[:, 0] - 0.5 * x[:, 5]
    w = torch.randn(4, 6, generator=gen(5), dtype=torch.float64)
    kept = kept_columns(6, [3])
    refit = refit_least_squares(w, x.T @ x, kept, damping=damping)
    assert rel(x[:, kept] @ refit.weight.T, x @ w.T) < tolerance
    assert rel(x[:, kept] @ w[:, kept].T, x @ w.T) > 0.1  # without the refit it is not


def test_refit_with_nothing_removed_returns_the_weight_in_its_dtype() -> None:
    x = inputs(50, 5)
    w = torch.randn(3, 5, generator=gen(2)).bfloat16()
    refit = refit_least_squares(w, x.T @ x, range(5))
    assert refit.info.method == "unchanged" and torch.equal(refit.weight, w)
    permuted = refit_least_squares(w.double(), x.T @ x, [4, 3, 2, 1, 0], damping=0.0)
    torch.testing.assert_close(permuted.weight, w.double()[:, [4, 3, 2, 1, 0]], rtol=1e-9, atol=1e-9)
    cast = refit_least_squares(w, x.T @ x, [0, 1, 3])
    assert cast.weight.dtype == torch.bfloat16 and cast.weight.shape == (3, 3)


def test_refit_to_dense_fits_dense_outputs_from_other_inputs() -> None:
    dense = inputs(150, 6, seed=6)
    compressed = dense + 0.1 * torch.randn(150, 6, generator=gen(7), dtype=torch.float64)
    w = torch.randn(4, 6, generator=gen(8), dtype=torch.float64)
    cross = CrossGramAccumulator(6, 6)
    cross.update(dense, compressed)
    kept = [0, 1, 2, 4]
    refit = refit_to_dense(w, cross.cross, compressed.T @ compressed, kept, damping=0.0)
    reference = torch.linalg.lstsq(compressed[:, kept], dense @ w.T).solution.T
    torch.testing.assert_close(refit.weight, reference, rtol=1e-9, atol=1e-9)


def test_joint_weight_and_bias_refit_on_the_augmented_gram() -> None:
    x = inputs(80, 5, seed=9)
    x[:, 1], x[:, 3] = 2.0, -0.7  # removed channels are constant
    w = torch.randn(3, 5, generator=gen(10), dtype=torch.float64)
    b = torch.randn(3, generator=gen(11), dtype=torch.float64)
    stats = GramStatistics(5)
    stats.update(x)
    augmented = with_bias_column(stats.gram, stats.sum, stats.tokens)
    kept = [0, 2, 4, 5]  # 5 is the constant column
    refit = refit_least_squares(torch.cat([w, b[:, None]], 1), augmented, kept, damping=0.0).weight
    out = x[:, [0, 2, 4]] @ refit[:, :3].T + refit[:, 3]
    assert rel(out, x @ w.T + b) < 1e-8


def test_a_ridge_toward_the_kept_columns_interpolates_between_refit_and_pruned_weight():
    from slimkit.primitives.reconstruct import refit_least_squares

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(6, 200, generator=generator, dtype=torch.float64)
    w = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    gram = x @ x.T
    kept = torch.tensor([0, 2, 3, 5])
    plain = refit_least_squares(w, gram, kept, damping=0.0).weight
    assert torch.allclose(refit_least_squares(w, gram, kept, damping=0.0, toward_kept=True).weight, plain)
    heavy = refit_least_squares(w, gram, kept, damping=1e6, toward_kept=True).weight
    assert torch.allclose(heavy, w[:, kept], atol=1e-4)  # a huge λ keeps the pruned weight
    lam_half = refit_least_squares(w, gram, kept, damping=1.0, toward_kept=True)
    k = kept
    expected = (w @ gram[:, k] + lam_half.info.lam * w[:, k]) @ torch.linalg.inv(
        gram[k][:, k] + lam_half.info.lam * torch.eye(4, dtype=torch.float64)
    )
    assert torch.allclose(lam_half.weight, expected, atol=1e-8)


def test_centred_is_the_covariance_sum() -> None:
    a, b = inputs(30, 4, seed=1), inputs(30, 3, seed=2)
    expected = (a - a.mean(0)).T @ (b - b.mean(0))
    torch.testing.assert_close(centred(a.T @ b, a.sum(0), b.sum(0), 30), expected)


def test_refit_affine_without_refit_is_flaps_mean_compensation() -> None:
    x, w = inputs(50, 6), torch.randn(3, 6, generator=gen(3), dtype=torch.float64)
    kept, removed = [0, 2, 3, 5], [1, 4]
    fit = refit_affine(w, x.T @ x, x.sum(0), 50, kept, refit=False)
    assert fit.info.method == "unchanged"
    torch.testing.assert_close(fit.weight, w[:, kept])
    torch.testing.assert_close(fit.bias_shift, bias_compensation(w, x.mean(0), removed))


def test_refit_affine_equals_the_least_squares_fit_with_a_free_bias() -> None:
    """Hand-built augmented problem: inputs [x_K; 1], ridge λ on the weights, none on the bias column."""
    x, w = inputs(60, 6, seed=4), torch.randn(3, 6, generator=gen(5), dtype=torch.float64)
    kept = [0, 1, 3, 5]
    for toward_kept in (False, True):
        fit = refit_affine(w, x.T @ x, x.sum(0), 60, kept, damping=0.05, toward_kept=toward_kept)
        lam = fit.info.lam
        z = torch.cat([x[:, kept], torch.ones(60, 1, dtype=torch.float64)], dim=1)  # T x (|K|+1)
        penalty = torch.diag(torch.tensor([lam] * len(kept) + [0.0], dtype=torch.float64))
        prior = torch.cat(
            [
                w[:, kept] if toward_kept else torch.zeros(3, len(kept), dtype=torch.float64),
                torch.zeros(3, 1, dtype=torch.float64),
            ],
            dim=1,
        )
        solution = ((x @ w.T).T @ z + prior @ penalty) @ torch.linalg.inv(z.T @ z + penalty)
        torch.testing.assert_close(fit.weight, solution[:, :-1], rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(fit.bias_shift, solution[:, -1], rtol=1e-8, atol=1e-8)


def test_refit_affine_is_lossless_when_the_removed_inputs_are_constant() -> None:
    x = inputs(40, 5, seed=6)
    x[:, [1, 3]] = torch.tensor([0.7, -2.0], dtype=torch.float64)  # constant on the data
    w = torch.randn(4, 5, generator=gen(7), dtype=torch.float64)
    kept = [0, 2, 4]
    for refit in (False, True):
        fit = refit_affine(w, x.T @ x, x.sum(0), 40, kept, refit=refit, damping=0.1, toward_kept=True)
        torch.testing.assert_close(x[:, kept] @ fit.weight.T + fit.bias_shift, x @ w.T, rtol=1e-9, atol=1e-9)


def test_refit_affine_dense_target_with_equal_inputs_matches_the_compressed_target() -> None:
    x, w = inputs(50, 6, seed=8), torch.randn(3, 6, generator=gen(9), dtype=torch.float64)
    g, s = x.T @ x, x.sum(0)
    same = refit_affine(w, g, s, 50, [0, 2, 5], damping=0.1, toward_kept=True)
    dense = refit_affine(w, g, s, 50, [0, 2, 5], cross=g, target_sum=s, damping=0.1, toward_kept=True)
    torch.testing.assert_close(dense.weight, same.weight)
    torch.testing.assert_close(dense.bias_shift, same.bias_shift)
    plain = refit_least_squares(w, g, [0, 2, 5], damping=0.1, toward_kept=True)
    torch.testing.assert_close(refit_to_dense(w, g, g, [0, 2, 5], damping=0.1, toward_kept=True).weight, plain.weight)
    with pytest.raises(ValueError, match="both cross and target_sum"):
        refit_affine(w, g, s, 50, [0], cross=g)


def test_refit_affine_dense_target_fits_dense_outputs_plus_mean() -> None:
    """Compressed inputs = dense inputs + a fixed offset: a free bias absorbs the offset exactly."""
    x_d = inputs(50, 5, seed=10)
    x_c = x_d + torch.tensor([0.5, -1.0, 0.2, 0.0, 3.0], dtype=torch.float64)
    w = torch.randn(2, 5, generator=gen(11), dtype=torch.float64)
    fit = refit_affine(
        w, x_c.T @ x_c, x_c.sum(0), 50, list(range(5)), cross=x_d.T @ x_c, target_sum=x_d.sum(0), damping=1e-12
    )
    torch.testing.assert_close(x_c @ fit.weight.T + fit.bias_shift, x_d @ w.T, rtol=1e-6, atol=1e-6)
