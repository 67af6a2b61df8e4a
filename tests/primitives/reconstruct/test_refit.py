"""primitives/reconstruct/refit.py: the refit settings, matching kept columns, and refitting one role of a layer."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct.consumer import DenseConsumer
from slimkit.primitives.reconstruct.error import embed_columns, output_error
from slimkit.primitives.reconstruct.least_squares import refit_least_squares
from slimkit.primitives.reconstruct.refit import (
    RefitSettings,
    affine_error,
    matched_columns,
    refit_role,
    refit_weights_only,
)
from tests.primitives.reconstruct.activations import gen, inputs


def test_refit_settings_refuse_what_cannot_work() -> None:
    assert RefitSettings().damping == 0.1 and RefitSettings().toward == "kept"
    with pytest.raises(ValidationError, match="at least 1e-12"):
        RefitSettings(damping=0.0)
    with pytest.raises(ValidationError, match="changes nothing"):
        RefitSettings(refit=False, bias="none")
    with pytest.raises(ValidationError, match="unknown field 'dampng'; did you mean 'damping'"):
        RefitSettings.model_validate({"dampng": 0.1})
    with pytest.raises(ValidationError):
        RefitSettings(damping=float("inf"))


def test_matched_columns_finds_the_kept_columns_in_order() -> None:
    dense = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert matched_columns(dense, dense[:, [1, 3]]).tolist() == [1, 3]
    assert matched_columns(dense, dense).tolist() == [0, 1, 2, 3]
    assert matched_columns(dense, dense[:, [3, 1]]) is None  # out of order: not a removal
    changed = dense[:, [0, 2]].clone()
    changed[0, 1] = 9.0
    assert matched_columns(dense, changed) is None
    assert matched_columns(dense, torch.zeros(3, 2)) is None  # another output width
    assert matched_columns(dense, torch.zeros(2, 5)) is None  # more columns than the dense weight


def test_refit_weights_only_is_the_least_squares_refit_with_a_zero_shift() -> None:
    x = inputs(80, 6, seed=3)
    w = torch.randn(3, 6, generator=gen(4), dtype=torch.float64)
    kept = torch.tensor([0, 2, 5])
    snapshot = DenseConsumer(w, x.T @ x, x.sum(0), 80)
    settings = RefitSettings(damping=1e-6, toward="zero")
    fitted = refit_weights_only(snapshot, kept, settings)
    expected = refit_least_squares(w, x.T @ x, kept, damping=1e-6).weight
    torch.testing.assert_close(fitted.weight, expected)
    assert torch.equal(fitted.bias_shift, torch.zeros(3, dtype=torch.float64))
    # With a zero shift, the affine error is the plain relative output error.
    approx = embed_columns(fitted.weight, kept, 6)
    assert affine_error(snapshot, approx, fitted.bias_shift) == pytest.approx(
        output_error(w, approx, x.T @ x, relative=True), rel=1e-9
    )


def test_refit_role_refits_the_pruned_down_projection(llama) -> None:
    from slimkit.primitives.arch import ModelView
    from slimkit.primitives.surgery import prune_layer

    view = ModelView(llama)
    down = view.layer(0).linear("down")
    x = inputs(120, down.in_features, seed=5)
    snapshot = DenseConsumer(down.weight.detach().double().clone(), x.T @ x, x.sum(0), 120)
    keep = torch.arange(0, down.in_features, 2)
    prune_layer(llama, "mlp_channel", 0, keep)
    pruned = down.weight.detach().double().clone()
    settings = RefitSettings(damping=1e-6, toward="zero")
    report = refit_role(view.layer(0), "down", snapshot, settings)
    assert report is not None and (report["kept"], report["of"]) == (keep.numel(), x.shape[1])
    expected = refit_least_squares(snapshot.weight, x.T @ x, keep, damping=1e-6).weight
    torch.testing.assert_close(down.weight.detach().double(), expected, rtol=1e-5, atol=1e-6)
    assert report["error_after"] < report["error_before"]
    assert report["error_before"] == pytest.approx(
        output_error(snapshot.weight, embed_columns(pruned, keep, x.shape[1]), x.T @ x, relative=True), rel=1e-6
    )
    # Roles that read the (unpruned) hidden stream have nothing to refit.
    q = view.layer(0).linear("q")
    assert refit_role(view.layer(0), "q", DenseConsumer(q.weight.detach().clone(), torch.eye(48)), settings) is None


def test_refit_role_refuses_columns_that_are_not_a_removal(llama) -> None:
    from slimkit.primitives.arch import ModelView

    view = ModelView(llama)
    down = view.layer(1).linear("down")
    width = down.in_features
    other = torch.randn(down.out_features, width + 2, dtype=torch.float64)  # the layer's columns are not in it
    snapshot = DenseConsumer(other, torch.eye(width + 2, dtype=torch.float64), tokens=1)
    with pytest.raises(SlimkitError, match="not a subset of its dense columns"):
        refit_role(view.layer(1), "down", snapshot, RefitSettings())
    target_dense = RefitSettings(target="dense")
    snapshot = DenseConsumer(
        torch.cat([down.weight.detach(), torch.ones(down.out_features, 2)], dim=1).double(),
        torch.eye(width + 2, dtype=torch.float64),
        tokens=1,
    )
    with pytest.raises(SlimkitError, match="no dense stream"):
        refit_role(view.layer(1), "down", snapshot, target_dense)
