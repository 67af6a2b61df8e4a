"""Calibration batches, activation-norm capture, and layer-by-layer execution."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.calibration import (
    CalibrationSpec,
    InputNormAccumulator,
    calibration_batches,
    capture_layer_inputs,
    input_norm_hooks,
    run_layer,
)
from slimkit.primitives.errors import SlimkitError


def test_input_norm_accumulator_hand_case():
    acc = InputNormAccumulator()
    acc.update(torch.tensor([[[3.0, 0.0], [4.0, 1.0]]]))  # [batch=1, tokens=2, features=2]
    acc.update(torch.tensor([[0.0, 2.0]]))
    torch.testing.assert_close(acc.norms(), torch.tensor([5.0, 5.0**0.5]))
    assert acc.tokens == 3


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["wikitext2", "c4", "ptb", "alpaca"])
def test_calibration_batches_shape_and_seed(tokenizer, dataset):
    spec = CalibrationSpec(dataset=dataset, samples=3, seq_len=16, seed=1)
    first = calibration_batches(tokenizer, spec)
    assert first.shape == (3, 16) and first.dtype == torch.long
    torch.testing.assert_close(first, calibration_batches(tokenizer, spec))
    other = calibration_batches(tokenizer, CalibrationSpec(dataset=dataset, samples=3, seq_len=16, seed=2))
    assert not torch.equal(first, other)


def test_unknown_calibration_dataset(tokenizer):
    with pytest.raises(SlimkitError, match="unknown dataset 'wiki'; known: wikitext2"):
        calibration_batches(tokenizer, CalibrationSpec(dataset="wiki"))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_layer_by_layer_execution_reproduces_the_model(family, request):
    model = request.getfixturevalue(family)
    view = ModelView(model)
    batches = [torch.randint(3, 200, (2, 10)), torch.randint(3, 200, (2, 10))]
    inputs = capture_layer_inputs(model, view.layer(0).module, batches)
    assert inputs.tokens == 40
    for layer in view.layers:
        inputs.hidden = run_layer(layer.module, inputs)
    for hidden, batch in zip(inputs.hidden, batches, strict=True):
        with torch.no_grad():
            logits = view.head(view.final_norm.module(hidden))
            torch.testing.assert_close(logits, model(batch).logits, rtol=1e-5, atol=1e-5)


def test_input_norm_hooks_see_every_token(llama):
    layer = ModelView(llama).layer(0)
    x = torch.randn(2, 5, 48)
    with input_norm_hooks({"q": layer.linear("q"), "down": layer.linear("down")}) as acc:
        layer.linear("q")(x)
    assert acc["q"].tokens == 10 and acc["down"].sum_sq is None
    torch.testing.assert_close(acc["q"].norms(), x.reshape(-1, 48).norm(dim=0))
