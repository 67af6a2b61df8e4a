"""The one finiteness check of weights (:mod:`slimkit.primitives.io.finite`): the first non-finite tensor named,
tensor by tensor, in bounded chunks."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io import finite
from slimkit.primitives.io.finite import all_finite, check_finite_weights, first_non_finite, non_finite_tensors


def test_the_first_non_finite_tensor_is_named(llama):
    assert first_non_finite(llama) is None
    check_finite_weights(llama, "model x")
    with torch.no_grad():
        llama.model.layers[2].self_attn.o_proj.weight[0, 0] = float("-inf")
        llama.model.layers[0].mlp.gate_proj.weight[1, 1] = float("nan")
    assert first_non_finite(llama) == "model.layers.0.mlp.gate_proj.weight"
    bad, checked = non_finite_tensors(llama)
    assert bad == ["model.layers.0.mlp.gate_proj.weight", "model.layers.2.self_attn.o_proj.weight"]
    assert checked == len({id(t) for t in llama.state_dict(keep_vars=True).values() if t.is_floating_point()})
    with pytest.raises(SlimkitError, match=r"^model x: weight model\.layers\.0\.mlp\.gate_proj\.weight holds NaN"):
        check_finite_weights(llama, "model x")


def test_big_tensors_are_checked_in_chunks(monkeypatch):
    monkeypatch.setattr(finite, "CHECK_CHUNK", 10)
    tensor = torch.zeros(7, 5)
    assert all_finite(tensor)
    tensor[6, 4] = float("inf")  # in the last chunk of two rows
    assert not all_finite(tensor)
    assert all_finite(torch.tensor(1.0)) and not all_finite(torch.tensor(float("nan")))
