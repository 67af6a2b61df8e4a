"""Refit of routed experts' down projections: exact where the removed channels are linear in the kept ones, never
worse than slicing, sliced only where no token came, errors from the Gram equal to the errors on the tokens."""

import pytest
import torch

from slimkit.primitives.experts.refit import refit_expert_down, weighted_error


def _grams(acts: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    """``sum w^2 a a^T`` of each expert's tokens."""
    return torch.stack([(a * w[:, None]).T @ (a * w[:, None]) for a, w in zip(acts, weights, strict=True)])


def test_removed_channels_linear_in_kept_ones_are_recovered_exactly():
    torch.manual_seed(0)
    experts, hidden, width, tokens = 2, 5, 4, 30
    acts, weights = [], []
    for _ in range(experts):
        a = torch.randn(tokens, width, dtype=torch.float64)
        a[:, 1] = 2.0 * a[:, 0] - a[:, 3]  # channel 1 is removed: a combination of kept channels 0 and 3
        acts.append(a)
        weights.append(torch.rand(tokens, dtype=torch.float64) + 0.1)
    down = torch.randn(experts, hidden, width, dtype=torch.float64)
    index = torch.tensor([[0, 2, 3], [0, 2, 3]])
    fitted = refit_expert_down(down, _grams(acts, weights), index, damping=0.0)
    for e in range(experts):
        # by hand: D' = D[:, K] + D[:, 1] (2, 0, -1) folds channel 1 into channels 0 and 3
        expected = down[e][:, [0, 2, 3]] + down[e][:, 1:2] * torch.tensor([2.0, 0.0, -1.0], dtype=torch.float64)
        torch.testing.assert_close(fitted.down[e], expected, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(acts[e][:, [0, 2, 3]] @ fitted.down[e].T, acts[e] @ down[e].T)
    assert fitted.relative_error(True) < 1e-12 < fitted.relative_error(False)
    assert fitted.sliced_only == [] and fitted.damping == [0.0, 0.0]


def test_refit_never_raises_the_weighted_error_and_the_errors_match_the_tokens():
    torch.manual_seed(1)
    experts, hidden, width, keep = 4, 6, 8, 5
    acts = [torch.randn(n, width) for n in (3, 20, 50, 1)]  # few tokens: rank-deficient Grams
    weights = [torch.rand(a.shape[0]) for a in acts]
    down = torch.randn(experts, hidden, width)
    index = torch.stack([torch.randperm(width)[:keep].sort().values for _ in range(experts)])
    fitted = refit_expert_down(down, _grams(acts, weights), index)
    assert fitted.down.shape == (experts, hidden, keep) and fitted.down.dtype == torch.float32
    for e in range(experts):
        a, w, kept = acts[e].double(), weights[e].double(), index[e]
        sliced = down[e][:, kept].double()
        dense = a @ down[e].double().T
        by_tokens = float(((dense - a[:, kept] @ sliced.T).pow(2).sum(1) * w**2).sum())
        refitted = float(((dense - a[:, kept] @ fitted.down[e].double().T).pow(2).sum(1) * w**2).sum())
        assert float(fitted.error_sliced[e]) == pytest.approx(by_tokens, rel=1e-4, abs=1e-6)
        assert float(fitted.error_refit[e]) == pytest.approx(refitted, rel=1e-4, abs=1e-5)
        assert refitted <= by_tokens * (1 + 1e-5) + 1e-6
        assert float(fitted.energy[e]) == pytest.approx(float((dense.pow(2).sum(1) * w**2).sum()), rel=1e-5)
    assert fitted.relative_error(True) < fitted.relative_error(False)


def test_an_expert_without_tokens_is_sliced_only():
    torch.manual_seed(2)
    down = torch.randn(2, 3, 4)
    a = torch.randn(10, 4)
    grams = torch.stack([torch.zeros(4, 4), a.T @ a])
    index = torch.tensor([[1, 3], [0, 1]])
    fitted = refit_expert_down(down, grams, index)
    assert fitted.sliced_only == [0]
    assert torch.equal(fitted.down[0], down[0][:, [1, 3]])
    assert not torch.equal(fitted.down[1], down[1][:, [0, 1]])
    assert float(fitted.error_refit[0]) == 0.0 == float(fitted.energy[0])


def test_weighted_error_by_hand_and_shape_checks():
    down = torch.tensor([[1.0, 2.0]])  # one output, two channels
    gram = torch.tensor([[1.0, 0.0], [0.0, 4.0]])  # two tokens of weight 1: a = (1, 0) and a = (0, 2)
    assert weighted_error(down, gram, down[:, [0]], torch.tensor([0])) == pytest.approx(16.0)  # (2 x 2)^2 lost
    assert weighted_error(down, gram, down, torch.tensor([0, 1])) == 0.0
    with pytest.raises(ValueError, match="grams must be"):
        refit_expert_down(torch.zeros(2, 3, 4), torch.zeros(2, 3, 3), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="index must be"):
        refit_expert_down(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4), torch.zeros(2, 5, dtype=torch.long))
