"""Scorers and selection on hand-checkable cases."""

from __future__ import annotations

import pytest
import torch
from slimkit.primitives.arch import ModelView
from slimkit.primitives.groups import Member, mlp_channel_group
from slimkit.primitives.importance import SCORERS, aggregate
from slimkit.primitives.select import keep_count, keep_top


def test_aggregations_hand_case():
    w = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert aggregate(w, 0, "l1").tolist() == [3.0, 7.0]
    assert aggregate(w, 0, "l2").tolist() == pytest.approx([5**0.5, 5.0])
    assert aggregate(w, 0, "linf").tolist() == [2.0, 4.0]
    assert aggregate(w, 1, "mean").tolist() == [2.0, 3.0]


def test_mlp_group_members(llama, opt):
    g = mlp_channel_group(ModelView(llama).layer(0))
    assert g.members == (Member("gate", 0), Member("up", 0), Member("down", 1)) and g.size == 64
    assert mlp_channel_group(ModelView(opt).layer(0)).members == (Member("up", 0), Member("down", 1))


def test_activation_score_is_weight_times_input_norm(opt):
    layer = ModelView(opt).layer(0)
    group = mlp_channel_group(layer)
    norms = {"up": torch.rand(32) + 0.5, "down": torch.rand(48) + 0.5}
    up, down = layer.linear("up").weight.detach(), layer.linear("down").weight.detach()
    expected = (up.abs() * norms["up"]).pow(2).sum(1).sqrt() + (down.abs() * norms["down"]).pow(2).sum(0).sqrt()
    got = SCORERS["activation"](group, layer, {"input_norms": norms}, aggregation="l2")
    torch.testing.assert_close(got, expected)


def test_random_scorer_is_seeded(llama):
    layer = ModelView(llama).layer(0)
    group = mlp_channel_group(layer)
    a = SCORERS["random"](group, layer, {}, generator=torch.Generator().manual_seed(3))
    b = SCORERS["random"](group, layer, {}, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (64,)


def test_keep_count_and_keep_top():
    assert keep_count(1536, 0.2) == 1229
    assert keep_count(1536, 0.2, multiple=64) == 1216
    assert keep_count(10, 0.99) == 1
    assert keep_top(torch.tensor([0.5, 3.0, 1.0, 3.0]), 2).tolist() == [1, 3]
    with pytest.raises(ValueError):
        keep_top(torch.tensor([1.0]), 2)
