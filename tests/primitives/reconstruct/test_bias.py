"""primitives/reconstruct/bias.py: mean compensation of removed inputs and a consumer's bias (config flags)."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct import (
    MeanAccumulator,
    bias_compensation,
    bias_refusal,
    consumer_bias,
)
from tests.primitives.reconstruct.activations import gen, inputs


def test_bias_compensation_is_lossless_for_constant_channels() -> None:
    x = inputs(60, 6, seed=21)
    x[:, 1], x[:, 4] = 1.5, -3.0
    w = torch.randn(3, 6, generator=gen(22), dtype=torch.float64)
    b = torch.randn(3, generator=gen(23), dtype=torch.float64)
    mean = MeanAccumulator(6)
    for chunk in x.split(25):
        mean.update(chunk)
    delta = bias_compensation(w, mean.mean(), [1, 4])
    kept = [0, 2, 3, 5]
    torch.testing.assert_close(x[:, kept] @ w[:, kept].T + b + delta, x @ w.T + b)
    # on varying channels it removes the mean of the output error
    y = inputs(60, 6, seed=24)
    delta = bias_compensation(w, y.mean(0), [0, 3])
    residual = y @ w.T - (y[:, [1, 2, 4, 5]] @ w[:, [1, 2, 4, 5]].T + delta)
    torch.testing.assert_close(residual.mean(0), torch.zeros(3, dtype=torch.float64))
    assert bias_compensation(w.bfloat16(), y.mean(0), [0]).dtype == torch.bfloat16


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
