"""primitives/reconstruct/obs_update.py: Optimal Brain Surgeon removal costs, order, updates and pruning."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.reconstruct import (
    contiguous_groups,
    embed_columns,
    inverse_hessian,
    obs_costs,
    obs_order,
    obs_prune,
    obs_remove,
    output_error,
    refit_least_squares,
)
from tests.primitives.reconstruct.activations import gen, inputs


def test_obs_removes_a_redundant_group_first_at_almost_no_cost() -> None:
    x = inputs(300, 12, seed=12)
    mix = torch.randn(2, 3, generator=gen(13), dtype=torch.float64)
    # head 2 (columns 6-8) is a combination of columns 0 and 3 of heads 0 and 1; no other head is
    # recoverable from the rest (heads 0 and 1 each keep two columns found nowhere else)
    x[:, 6:9] = x[:, [0, 3]] @ mix
    w = torch.randn(5, 12, generator=gen(14), dtype=torch.float64)
    groups = contiguous_groups(12, 3)
    hinv, _ = inverse_hessian(x.T @ x, damping=1e-9)
    costs = obs_costs(w, hinv, groups)
    assert costs.shape == (4,) and bool((costs >= 0).all())
    assert float(costs[2]) < 1e-5 * float(costs[[0, 1, 3]].min())
    order = obs_order(w, hinv, groups)
    assert order.order[0] == 2 and sorted(order.order) == [0, 1, 2, 3]
    assert bool((order.costs >= 0).all()) and float(order.costs[0]) < 1e-5 * float(order.costs[1:].sum())


def test_obs_update_equals_the_least_squares_refit() -> None:
    x = inputs(400, 12, seed=15)
    w = torch.randn(6, 12, generator=gen(16), dtype=torch.float64)
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
    x = inputs(100, 6, seed=17)
    w = torch.randn(4, 6, generator=gen(18), dtype=torch.float64)
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
    x = inputs(120, 9, seed=19)
    w = torch.randn(4, 9, generator=gen(20)).bfloat16()
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
