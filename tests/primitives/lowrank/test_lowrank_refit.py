"""Activation-aware low-rank factors (issue #17): SVD-LLM's whitened SVD (`lowrank` method `whiten`) and the refit of
a low-rank pair's left factor (`reconstruct` on a low-rank role)."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import LowRankLinear, activation_weighted_svd, whitened_svd
from slimkit.primitives.reconstruct import output_error, refit_left
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import model_output


def _correlated_inputs(d_in: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """``X`` (``d_in x tokens``) with strongly correlated features and uneven scales, in float64."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d_in, d_in, generator=g, dtype=torch.float64) * torch.logspace(0, 1.5, d_in).double()
    return mixing @ torch.randn(d_in, tokens, generator=g, dtype=torch.float64)


def test_whitened_svd_with_a_diagonal_gram_is_awsvd():
    # G = diag(d²) is what AWSVD assumes: both give the same product L R (the factors may differ in sign).
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(7, 5, generator=g, dtype=torch.float64)
    norms = torch.tensor([0.5, 2.0, 1.0, 4.0, 0.25], dtype=torch.float64)
    left_w, right_w = whitened_svd(weight, torch.diag(norms**2), 3, damping=1e-14)
    left_a, right_a = activation_weighted_svd(weight, norms, 3)
    torch.testing.assert_close(left_w @ right_w, left_a @ right_a, rtol=1e-9, atol=1e-9)


def test_whitened_svd_error_is_the_tail_of_the_whitened_spectrum_and_beats_awsvd():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(12, 10, generator=g, dtype=torch.float64)
    x = _correlated_inputs(10, 200)
    gram = x @ x.T
    rank = 4
    left, right = whitened_svd(weight, gram, rank, damping=1e-14)
    error = float(((weight - left @ right) @ x).square().sum())
    # ||(W - LR) X||² = ||(W - LR) S||² with S Sᵀ = G: the discarded σ² of W S (Eckart–Young in the whitened basis).
    s = torch.linalg.svdvals(weight @ torch.linalg.cholesky(gram))
    assert error == pytest.approx(float(s[rank:].square().sum()), rel=1e-8)
    left_a, right_a = activation_weighted_svd(weight, x.norm(dim=1), rank)
    assert error < float(((weight - left_a @ right_a) @ x).square().sum())
    # Full rank is lossless.
    left_f, right_f = whitened_svd(weight, gram, 10, damping=1e-14)
    torch.testing.assert_close(left_f @ right_f, weight, rtol=1e-8, atol=1e-8)


def test_whitened_svd_keeps_dtype_and_refuses_bad_grams():
    weight = torch.randn(6, 4)
    left, right = whitened_svd(weight, torch.eye(4, dtype=torch.float64), 2)
    assert left.dtype == right.dtype == torch.float32 and left.shape == (6, 2) and right.shape == (2, 4)
    with pytest.raises(ValueError, match="d_in x d_in"):
        whitened_svd(weight, torch.eye(5), 2)
    with pytest.raises(ValueError, match="non-finite"):
        whitened_svd(weight, torch.full((4, 4), float("nan")), 2)
    # A singular Gram (a dead input feature) is solved by the escalating damping.
    singular = torch.diag(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64))
    left, right = whitened_svd(weight, singular, 2)
    assert torch.isfinite(left @ right).all()


def test_refit_left_after_awsvd_lowers_the_output_error_and_toward_keeps_it_with_a_large_ridge():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(9, 8, generator=g, dtype=torch.float64)
    x = _correlated_inputs(8, 300, seed=4)
    gram = x @ x.T
    left, right = activation_weighted_svd(weight, x.norm(dim=1), 3)
    refit = refit_left(weight, right, gram, damping=1e-12).weight
    before = output_error(weight, left @ right, gram)
    assert output_error(weight, refit @ right, gram) < before
    # Hand-checkable: the normal equations of min ||W X − L R X||², L' = W G Rᵀ (R G Rᵀ)⁻¹.
    expected = weight @ gram @ right.T @ torch.linalg.inv(right @ gram @ right.T)
    torch.testing.assert_close(refit, expected, rtol=1e-6, atol=1e-8)
    # toward: a huge ridge leaves L as it was; toward zero it would shrink L.
    kept = refit_left(weight, right, gram, damping=1e8, toward=left).weight
    torch.testing.assert_close(kept, left, rtol=1e-5, atol=1e-7)
    assert refit_left(weight, right, gram, damping=1e8).weight.norm() < 1e-4 * left.norm()
    # After whitening, the left factor is already optimal: the refit does not move it.
    left_w, right_w = whitened_svd(weight, gram, 3, damping=1e-14)
    torch.testing.assert_close(refit_left(weight, right_w, gram, damping=1e-14).weight, left_w, rtol=1e-6, atol=1e-8)


LORAP_TARGET = {"ratio": 0.15, "of": "model", "tolerance": 0.2}


def _lowrank_stages(method: str, reconstruct: dict | None):
    children = [
        {"stage": "lowrank", "args": {"roles": ["q", "k", "v", "o"], "method": method, "allocation": "uniform"}},
        {"stage": "prune_layer", "args": {"groups": ["mlp_channel"], "scorer": "activation", "ratio_rule": "layer"}},
    ]
    if reconstruct is not None:
        children.append({"stage": "reconstruct", "args": reconstruct})
    return [{"sequential": children}]


def test_lowrank_whiten_runs_saves_and_reloads(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(tiny_llama_dir, target=LORAP_TARGET, stages=_lowrank_stages("whiten", None))
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    assert report["stages"]["lowrank"]["ranks"]
    model, _ = slimkit.load(tmp_path / "run" / "model")
    assert isinstance(model.model.layers[0].self_attn.q_proj, LowRankLinear)
    ids = torch.randint(3, 200, (2, 9))
    assert torch.isfinite(model_output(model, ids)).all()


@pytest.mark.slow
def test_reconstruct_refits_the_left_factor_of_every_lowrank_role(tmp_path, tiny_llama_dir):
    stages = _lowrank_stages("awsvd", {"roles": ["q", "k", "v", "o", "down"], "damping": 1e-6})
    raw = tiny_recipe(tiny_llama_dir, target=LORAP_TARGET, stages=stages)
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    layers = report["stages"]["reconstruct"]["layers"]
    assert set(layers) == {"q", "k", "v", "o", "down"}
    for role in ("q", "k", "v", "o"):
        for result in layers[role].values():
            assert result["rank"] < result["of"]
            assert result["error_after"] <= result["error_before"] + 1e-12
    plain = tiny_recipe(tiny_llama_dir, target=raw["target"], stages=_lowrank_stages("awsvd", None))
    plain_report = slimkit.run(plain, tmp_path / "plain").report.as_json()
    assert plain_report["params"]["after"] == report["params"]["after"]  # same ranks and widths, refitted values


def test_a_lowrank_role_that_was_never_factored_is_refused_or_flagged(tmp_path, tiny_llama_dir):
    def stages(roles):
        prune = {"stage": "prune_layer", "args": {"groups": ["mlp_channel"], "scorer": "activation"}}
        return [{"sequential": [prune, {"stage": "reconstruct", "args": {"roles": roles}}]}]

    target = {"ratio": 0.2, "of": "mlp", "tolerance": 0.1}
    raw = tiny_recipe(tiny_llama_dir, target=target, stages=stages(["q"]))
    with pytest.raises(SlimkitError, match=r"refit q, but no stage .* or made them low-rank") as caught:
        slimkit.run(raw, tmp_path / "run")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run" / "model").exists()
    # Some roles refitted, others not: the run goes on and the report says which were not.
    raw = tiny_recipe(tiny_llama_dir, target=target, stages=stages(["down", "q", "o"]))
    report = slimkit.run(raw, tmp_path / "flagged").report.as_json()
    assert report["stages"]["reconstruct"]["not_refitted"] == ["q", "o"]
    assert any("q, o refitted in no layer" in note for note in report["notes"])


def test_bias_mean_on_a_lowrank_role_is_refused_in_one_line(tmp_path, tiny_llama_dir):
    stages = _lowrank_stages("awsvd", {"roles": ["o"], "bias": "mean"})
    raw = tiny_recipe(tiny_llama_dir, target=LORAP_TARGET, stages=stages)
    with pytest.raises(SlimkitError, match="low-rank pair and bias: mean"):
        slimkit.run(raw, tmp_path / "run")
