"""primitives/reconstruct: streamed statistics, least-squares / OBS / bias / low-rank refits.

Tiny hand-checkable cases: activations are rows ``x_t`` of ``X`` (``T x d``), so the module doc's
``G = X Xᵀ`` is ``X.T @ X`` here and a consumer's outputs are ``X @ W.T``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.svd import activation_weighted_svd, truncated_svd
from slimkit.primitives.reconstruct import (
    CrossGramAccumulator,
    GramStatistics,
    MeanAccumulator,
    bias_compensation,
    bias_refusal,
    centred,
    consumer_bias,
    contiguous_groups,
    damped_inverse,
    damped_solve,
    embed_columns,
    gram_hooks,
    inverse_hessian,
    kept_columns,
    obs_costs,
    obs_order,
    obs_prune,
    obs_remove,
    output_energy,
    output_error,
    refit_affine,
    refit_least_squares,
    refit_left,
    refit_to_dense,
    with_bias_column,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(tokens: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Correlated, anisotropic float64 activations (``T x d``), full column rank."""
    g = _gen(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) * torch.logspace(0, -1, dim, dtype=torch.float64)
    return torch.randn(tokens, dim, generator=g, dtype=torch.float64) @ mix + 0.3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- gram ---------------------------------------------------------------------------------------


def test_gram_statistics_streams_batches_of_any_shape_and_dtype() -> None:
    x = _inputs(40, 6)
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
    a, b = _inputs(30, 5, seed=1), _inputs(30, 3, seed=2)
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
    x = _inputs(20, 4, seed=3)
    stats = GramStatistics(4)
    stats.update(x)
    augmented = torch.cat([x, torch.ones(20, 1, dtype=x.dtype)], dim=1)
    torch.testing.assert_close(with_bias_column(stats.gram, stats.sum, stats.tokens), augmented.T @ augmented)


# --- solve --------------------------------------------------------------------------------------


def test_damped_solve_escalates_then_falls_back_to_lstsq() -> None:
    gram = torch.diag(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    rhs = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    solution, info = damped_solve(rhs, gram, damping=0.0)
    assert info.method == "cholesky" and info.damping == pytest.approx(1e-9)
    torch.testing.assert_close(solution, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), rtol=1e-8, atol=1e-8)

    negative = -torch.eye(3, dtype=torch.float64)  # never positive definite at small damping
    solution, info = damped_solve(rhs, negative, damping=1e-3, retries=2)
    assert info.method == "lstsq" and info.damping == 1e-3
    torch.testing.assert_close(solution, rhs / (-1 + 1e-3))
    inverse, info = damped_inverse(negative, damping=0.0)
    assert info.method == "lstsq"
    torch.testing.assert_close(inverse, -torch.eye(3, dtype=torch.float64))


def test_damped_solve_damping_is_relative_to_the_diagonal() -> None:
    gram = torch.diag(torch.tensor([4.0, 2.0], dtype=torch.float64))  # mean diag 3
    solution, info = damped_solve(torch.tensor([[4.0, 2.0]], dtype=torch.float64), gram, damping=0.5)
    assert info.lam == pytest.approx(1.5)
    torch.testing.assert_close(solution, torch.tensor([[4 / 5.5, 2 / 3.5]], dtype=torch.float64))


# --- least squares ------------------------------------------------------------------------------


def test_refit_without_damping_is_the_exact_least_squares_solution() -> None:
    x = _inputs(200, 8)
    w = torch.randn(5, 8, generator=_gen(1), dtype=torch.float64)
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
    x = _inputs(100, 6, seed=4)
    x[:, 3] = 2 * x[:, 0] - 0.5 * x[:, 5]
    w = torch.randn(4, 6, generator=_gen(5), dtype=torch.float64)
    kept = kept_columns(6, [3])
    refit = refit_least_squares(w, x.T @ x, kept, damping=damping)
    assert _rel(x[:, kept] @ refit.weight.T, x @ w.T) < tolerance
    assert _rel(x[:, kept] @ w[:, kept].T, x @ w.T) > 0.1  # without the refit it is not


def test_refit_with_nothing_removed_returns_the_weight_in_its_dtype() -> None:
    x = _inputs(50, 5)
    w = torch.randn(3, 5, generator=_gen(2)).bfloat16()
    refit = refit_least_squares(w, x.T @ x, range(5))
    assert refit.info.method == "unchanged" and torch.equal(refit.weight, w)
    permuted = refit_least_squares(w.double(), x.T @ x, [4, 3, 2, 1, 0], damping=0.0)
    torch.testing.assert_close(permuted.weight, w.double()[:, [4, 3, 2, 1, 0]], rtol=1e-9, atol=1e-9)
    cast = refit_least_squares(w, x.T @ x, [0, 1, 3])
    assert cast.weight.dtype == torch.bfloat16 and cast.weight.shape == (3, 3)


def test_refit_to_dense_fits_dense_outputs_from_other_inputs() -> None:
    dense = _inputs(150, 6, seed=6)
    compressed = dense + 0.1 * torch.randn(150, 6, generator=_gen(7), dtype=torch.float64)
    w = torch.randn(4, 6, generator=_gen(8), dtype=torch.float64)
    cross = CrossGramAccumulator(6, 6)
    cross.update(dense, compressed)
    kept = [0, 1, 2, 4]
    refit = refit_to_dense(w, cross.cross, compressed.T @ compressed, kept, damping=0.0)
    reference = torch.linalg.lstsq(compressed[:, kept], dense @ w.T).solution.T
    torch.testing.assert_close(refit.weight, reference, rtol=1e-9, atol=1e-9)


def test_joint_weight_and_bias_refit_on_the_augmented_gram() -> None:
    x = _inputs(80, 5, seed=9)
    x[:, 1], x[:, 3] = 2.0, -0.7  # removed channels are constant
    w = torch.randn(3, 5, generator=_gen(10), dtype=torch.float64)
    b = torch.randn(3, generator=_gen(11), dtype=torch.float64)
    stats = GramStatistics(5)
    stats.update(x)
    augmented = with_bias_column(stats.gram, stats.sum, stats.tokens)
    kept = [0, 2, 4, 5]  # 5 is the constant column
    refit = refit_least_squares(torch.cat([w, b[:, None]], 1), augmented, kept, damping=0.0).weight
    out = x[:, [0, 2, 4]] @ refit[:, :3].T + refit[:, 3]
    assert _rel(out, x @ w.T + b) < 1e-8


# --- obs ----------------------------------------------------------------------------------------


def test_obs_removes_a_redundant_group_first_at_almost_no_cost() -> None:
    x = _inputs(300, 12, seed=12)
    mix = torch.randn(2, 3, generator=_gen(13), dtype=torch.float64)
    # head 2 (columns 6-8) is a combination of columns 0 and 3 of heads 0 and 1; no other head is
    # recoverable from the rest (heads 0 and 1 each keep two columns found nowhere else)
    x[:, 6:9] = x[:, [0, 3]] @ mix
    w = torch.randn(5, 12, generator=_gen(14), dtype=torch.float64)
    groups = contiguous_groups(12, 3)
    hinv, _ = inverse_hessian(x.T @ x, damping=1e-9)
    costs = obs_costs(w, hinv, groups)
    assert costs.shape == (4,) and bool((costs >= 0).all())
    assert float(costs[2]) < 1e-5 * float(costs[[0, 1, 3]].min())
    order = obs_order(w, hinv, groups)
    assert order.order[0] == 2 and sorted(order.order) == [0, 1, 2, 3]
    assert bool((order.costs >= 0).all()) and float(order.costs[0]) < 1e-5 * float(order.costs[1:].sum())


def test_obs_update_equals_the_least_squares_refit() -> None:
    x = _inputs(400, 12, seed=15)
    w = torch.randn(6, 12, generator=_gen(16), dtype=torch.float64)
    gram = x.T @ x
    groups = contiguous_groups(12, 3)
    result = obs_prune(w, gram, groups, n_remove=2, damping=0.0)
    assert len(result.removed_groups) == 2 and result.kept_groups == sorted(set(range(4)) - set(result.removed_groups))
    assert result.kept_columns.tolist() == sorted(c for g in result.kept_groups for c in groups[g])
    refit = refit_least_squares(w, gram, result.kept_columns, damping=0.0)
    torch.testing.assert_close(result.weight, refit.weight, rtol=1e-8, atol=1e-8)
    obs_error = output_error(w, embed_columns(result.weight, result.kept_columns, 12), gram)
    ls_error = output_error(w, embed_columns(refit.weight, result.kept_columns, 12), gram)
    assert obs_error == pytest.approx(ls_error, rel=1e-8)
    assert float(result.costs.sum()) == pytest.approx(obs_error, rel=1e-8)  # step costs add up to the error
    assert bool((result.costs >= 0).all())

    # with damping, OBS is the least-squares refit on G + λI (pulled towards W rather than 0)
    damped = obs_prune(w, gram, groups, n_remove=2, damping=0.01)
    lam = 0.01 * float(gram.diagonal().mean())
    shifted = gram + lam * torch.eye(12, dtype=torch.float64)
    reference = refit_least_squares(w, shifted, damped.kept_columns, damping=0.0)
    torch.testing.assert_close(damped.weight, reference.weight, rtol=1e-8, atol=1e-8)
    assert damped.info.lam == pytest.approx(lam)


def test_obs_remove_zeroes_the_group_and_downdates_the_inverse_hessian() -> None:
    x = _inputs(100, 6, seed=17)
    w = torch.randn(4, 6, generator=_gen(18), dtype=torch.float64)
    hessian = x.T @ x
    hinv, _ = inverse_hessian(hessian, damping=0.0)
    step = obs_remove(w, hinv, [1, 4])
    rest = [0, 2, 3, 5]
    assert bool((step.weight[:, [1, 4]] == 0).all()) and bool((step.hinv[[1, 4]] == 0).all())
    torch.testing.assert_close(step.hinv[rest][:, rest], torch.linalg.inv(hessian[rest][:, rest]))
    # single channels: the cost is ||W_j||² / Hinv_jj, and it is the error of the step
    costs = obs_costs(w, hinv, [[j] for j in range(6)])
    torch.testing.assert_close(costs, w.pow(2).sum(0) / hinv.diagonal())
    one = obs_remove(w, hinv, [2])
    assert one.cost == pytest.approx(float(costs[2]), rel=1e-10)
    assert output_error(w, one.weight, hessian) == pytest.approx(one.cost, rel=1e-8)


def test_obs_prune_keeps_dtype_uncovered_columns_and_mixed_group_sizes() -> None:
    x = _inputs(120, 9, seed=19)
    w = torch.randn(4, 9, generator=_gen(20)).bfloat16()
    groups = [[0, 1], [2], [3, 4, 5], [7]]  # columns 6 and 8 belong to no group
    result = obs_prune(w, x.T @ x, groups, n_remove=3)
    assert result.weight.dtype == torch.bfloat16 and result.weight.shape == (4, result.kept_columns.numel())
    assert {6, 8} <= set(result.kept_columns.tolist()) and len(result.kept_groups) == 1
    assert obs_prune(w, x.T @ x, groups, n_remove=0).weight.shape == (4, 9)
    with pytest.raises(ValueError):
        obs_prune(w, x.T @ x, [[0, 1], [1, 2]], n_remove=1)
    with pytest.raises(ValueError):
        obs_prune(w, x.T @ x, groups, n_remove=5)
    with pytest.raises(ValueError):
        contiguous_groups(10, 3)


# --- bias ---------------------------------------------------------------------------------------


def test_bias_compensation_is_lossless_for_constant_channels() -> None:
    x = _inputs(60, 6, seed=21)
    x[:, 1], x[:, 4] = 1.5, -3.0
    w = torch.randn(3, 6, generator=_gen(22), dtype=torch.float64)
    b = torch.randn(3, generator=_gen(23), dtype=torch.float64)
    mean = MeanAccumulator(6)
    for chunk in x.split(25):
        mean.update(chunk)
    delta = bias_compensation(w, mean.mean(), [1, 4])
    kept = [0, 2, 3, 5]
    torch.testing.assert_close(x[:, kept] @ w[:, kept].T + b + delta, x @ w.T + b)
    # on varying channels it removes the mean of the output error
    y = _inputs(60, 6, seed=24)
    delta = bias_compensation(w, y.mean(0), [0, 3])
    residual = y @ w.T - (y[:, [1, 2, 4, 5]] @ w[:, [1, 2, 4, 5]].T + delta)
    torch.testing.assert_close(residual.mean(0), torch.zeros(3, dtype=torch.float64))
    assert bias_compensation(w.bfloat16(), y.mean(0), [0]).dtype == torch.bfloat16


# --- low-rank -----------------------------------------------------------------------------------


def test_refit_left_is_exact_when_right_spans_the_row_space() -> None:
    x = _inputs(100, 10, seed=25)
    g = _gen(26)
    rows = torch.randn(3, 10, generator=g, dtype=torch.float64)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64) @ rows  # rank 3
    right = torch.randn(5, 5, generator=g, dtype=torch.float64) @ torch.cat(
        [rows, torch.randn(2, 10, generator=g, dtype=torch.float64)]
    )
    refit = refit_left(w, right, x.T @ x, damping=0.0)
    assert refit.weight.shape == (6, 5)
    assert _rel(x @ (refit.weight @ right).T, x @ w.T) < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refit_left_is_never_worse_than_svd_on_the_calibration_gram(seed: int) -> None:
    x = _inputs(200, 12, seed=30 + seed)
    w = torch.randn(8, 12, generator=_gen(40 + seed), dtype=torch.float64)
    gram = x.T @ x
    norms = x.pow(2).sum(0).sqrt()
    for rank in (2, 5, 8):
        for left, right in (truncated_svd(w, rank), activation_weighted_svd(w, norms, rank)):
            refit = refit_left(w, right, gram, damping=0.0)
            floor = 1e-12 * output_error(w, torch.zeros_like(w), gram)  # rank 8 = d_out: both exact
            assert output_error(w, refit.weight @ right, gram) <= output_error(w, left @ right, gram) + floor


def test_refit_left_with_cross_fits_dense_outputs() -> None:
    dense = _inputs(150, 7, seed=50)
    compressed = dense + 0.2 * torch.randn(150, 7, generator=_gen(51), dtype=torch.float64)
    w = torch.randn(5, 7, generator=_gen(52), dtype=torch.float64)
    _, right = truncated_svd(w, 3)
    refit = refit_left(w, right, compressed.T @ compressed, cross=dense.T @ compressed, damping=0.0)
    reference = torch.linalg.lstsq(compressed @ right.T, dense @ w.T).solution.T
    torch.testing.assert_close(refit.weight, reference, rtol=1e-9, atol=1e-9)
    cast = refit_left(w.float(), right.float(), compressed.T @ compressed)
    assert cast.weight.dtype == torch.float32


# --- error helpers ------------------------------------------------------------------------------


def test_output_error_and_column_helpers() -> None:
    x = _inputs(30, 4, seed=60)
    w = torch.randn(2, 4, generator=_gen(61), dtype=torch.float64)
    approx = torch.randn(2, 4, generator=_gen(62), dtype=torch.float64)
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


# --- joint weight + bias refit, dense targets, consumer biases ----------------------------------------


def test_centred_is_the_covariance_sum() -> None:
    a, b = _inputs(30, 4, seed=1), _inputs(30, 3, seed=2)
    expected = (a - a.mean(0)).T @ (b - b.mean(0))
    torch.testing.assert_close(centred(a.T @ b, a.sum(0), b.sum(0), 30), expected)


def test_refit_affine_without_refit_is_flaps_mean_compensation() -> None:
    x, w = _inputs(50, 6), torch.randn(3, 6, generator=_gen(3), dtype=torch.float64)
    kept, removed = [0, 2, 3, 5], [1, 4]
    fit = refit_affine(w, x.T @ x, x.sum(0), 50, kept, refit=False)
    assert fit.info.method == "unchanged"
    torch.testing.assert_close(fit.weight, w[:, kept])
    torch.testing.assert_close(fit.bias_shift, bias_compensation(w, x.mean(0), removed))


def test_refit_affine_equals_the_least_squares_fit_with_a_free_bias() -> None:
    """Hand-built augmented problem: inputs [x_K; 1], ridge λ on the weights, none on the bias column."""
    x, w = _inputs(60, 6, seed=4), torch.randn(3, 6, generator=_gen(5), dtype=torch.float64)
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
    x = _inputs(40, 5, seed=6)
    x[:, [1, 3]] = torch.tensor([0.7, -2.0], dtype=torch.float64)  # constant on the data
    w = torch.randn(4, 5, generator=_gen(7), dtype=torch.float64)
    kept = [0, 2, 4]
    for refit in (False, True):
        fit = refit_affine(w, x.T @ x, x.sum(0), 40, kept, refit=refit, damping=0.1, toward_kept=True)
        torch.testing.assert_close(x[:, kept] @ fit.weight.T + fit.bias_shift, x @ w.T, rtol=1e-9, atol=1e-9)


def test_refit_affine_dense_target_with_equal_inputs_matches_the_compressed_target() -> None:
    x, w = _inputs(50, 6, seed=8), torch.randn(3, 6, generator=_gen(9), dtype=torch.float64)
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
    x_d = _inputs(50, 5, seed=10)
    x_c = x_d + torch.tensor([0.5, -1.0, 0.2, 0.0, 3.0], dtype=torch.float64)
    w = torch.randn(2, 5, generator=_gen(11), dtype=torch.float64)
    fit = refit_affine(
        w, x_c.T @ x_c, x_c.sum(0), 50, list(range(5)), cross=x_d.T @ x_c, target_sum=x_d.sum(0), damping=1e-12
    )
    torch.testing.assert_close(x_c @ fit.weight.T + fit.bias_shift, x_d @ w.T, rtol=1e-6, atol=1e-6)


def test_consumer_bias_sets_the_global_flag_and_keeps_the_function() -> None:
    from slimkit.primitives.arch import ModelView
    from tests.tiny import model_output, tiny_llama, tiny_mistral, tiny_opt, tiny_qwen2, tiny_qwen3

    model = tiny_llama()
    ids = torch.randint(3, 200, (2, 7))
    before = model_output(model, ids)
    view = ModelView(model)
    bias = consumer_bias(model, view, view.layer(1), "down")
    assert model.config.mlp_bias and not model.config.attention_bias
    assert bias is view.layer(1).linear("down").bias and bias.shape == (48,)
    for layer in view.layers:
        for role in ("gate", "up", "down"):
            assert torch.equal(layer.linear(role).bias, torch.zeros(layer.linear(role).out_features))
        assert layer.linear("o").bias is None
    torch.testing.assert_close(model_output(model, ids), before, rtol=0, atol=0)
    consumer_bias(model, view, view.layer(0), "o")
    assert model.config.attention_bias and view.layer(2).linear("q").bias is not None
    for build, role in [(tiny_mistral, "down"), (tiny_mistral, "o"), (tiny_qwen2, "o"), (tiny_qwen3, "down")]:
        other = build()
        layer = ModelView(other).layer(0)
        assert "no config flag" in bias_refusal(other, layer, role)
        with pytest.raises(SlimkitError, match="no config flag"):
            consumer_bias(other, ModelView(other), layer, role)
    qwen3 = tiny_qwen3()
    assert bias_refusal(qwen3, ModelView(qwen3).layer(0), "o") is None
    opt = tiny_opt()
    assert bias_refusal(opt, ModelView(opt).layer(0), "down") is None  # fc2 has its bias already


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
