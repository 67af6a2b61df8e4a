"""SlimGPT's batched greedy OBS (``per_update``): one group per update is the one-at-a-time greedy; on a diagonal
Hessian every batch size picks the same columns by hand; any batch size ends at the exact OBS weights of what it kept,
and the round costs add up to the layer-wise loss."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.reconstruct import inverse_hessian, obs_costs, obs_prune, obs_remove, refit_least_squares
from slimkit.primitives.reconstruct.error import embed_columns, output_error


def _problem(width=12, out=5, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(width, 300, dtype=torch.float64)
    x[3] = x[4] + 0.1 * x[3]  # correlated columns: an update moves weight between them
    return torch.randn(out, width, dtype=torch.float64), x @ x.T


def test_one_group_per_update_is_the_one_at_a_time_greedy():
    """The reference greedy built from the public one-step functions: cheapest group, remove it, repeat."""
    weight, gram = _problem()
    groups = [[c] for c in range(12)]
    result = obs_prune(weight, gram, groups, 5, per_update=1)
    hinv, _ = inverse_hessian(gram)
    w, removed = weight.clone(), []
    for _ in range(5):
        active = [g for g in range(12) if g not in removed]
        costs = obs_costs(w, hinv, [groups[g] for g in active])
        gid = active[int(torch.argmin(costs))]
        step = obs_remove(w, hinv, groups[gid])
        w, hinv = step.weight, step.hinv
        removed.append(gid)
    assert result.removed_groups == removed
    torch.testing.assert_close(result.weight, w[:, result.kept_columns], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("per_update", [1, 2, 3, 6])
def test_a_diagonal_hessian_picks_the_smallest_weighted_norms_by_hand(per_update):
    """H = diag(h): removing column j costs ||W_j||^2 (h_j + lam) and moves no other column, so every batch size
    removes the columns of the 6 smallest costs and leaves the kept columns as they were."""
    h = torch.tensor([1.0, 4.0, 0.5, 2.0, 3.0, 0.25, 1.5, 5.0, 0.75, 2.5], dtype=torch.float64)
    weight = torch.ones(2, 10, dtype=torch.float64)
    result = obs_prune(weight, torch.diag(h), [[c] for c in range(10)], 6, damping=1e-9, per_update=per_update)
    assert sorted(result.removed_groups) == [0, 2, 3, 5, 6, 8]  # h = 1, 0.5, 2, 0.25, 1.5, 0.75
    torch.testing.assert_close(result.weight, torch.ones(2, 4, dtype=torch.float64))
    assert float(result.costs.sum()) == pytest.approx(2 * (1 + 0.5 + 2 + 0.25 + 1.5 + 0.75), rel=1e-6)


@pytest.mark.parametrize("per_update", [2, 4])
def test_any_batch_size_ends_at_the_exact_refit_of_what_it_kept(per_update):
    """Each round is exact OBS on its union of columns, so the result is the optimal update of the kept columns
    (with tiny damping: the least-squares refit) and the costs sum to the output error it leaves."""
    weight, gram = _problem()
    result = obs_prune(weight, gram, [[c] for c in range(12)], 6, damping=1e-12, per_update=per_update)
    refit = refit_least_squares(weight, gram, result.kept_columns, damping=0.0)
    torch.testing.assert_close(result.weight, refit.weight, rtol=1e-7, atol=1e-9)
    error = output_error(weight, embed_columns(result.weight, result.kept_columns, 12), gram, relative=False)
    assert float(result.costs.sum()) == pytest.approx(float(error), rel=1e-6)


def test_batched_rounds_keep_the_gqa_quota_per_block():
    weight, gram = _problem()
    groups = [[2 * i, 2 * i + 1] for i in range(6)]
    result = obs_prune(weight, gram, groups, 4, blocks=2, per_update=4)
    assert sorted(g // 3 for g in result.removed_groups) == [0, 0, 1, 1]
