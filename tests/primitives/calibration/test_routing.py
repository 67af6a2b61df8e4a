"""Routing-following calibration: per-expert counts, mass and channel norms from only the routed tokens."""

import pytest
import torch

from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.calibration.routing import collect_routing
from slimkit.primitives.experts.routed import ExpertWeights, expert_intermediate, routing
from tests.tiny import MOE_FAMILIES


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_statistics_follow_the_routing(family):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family]()
    batches = [torch.randint(3, 300, (2, 6)) for _ in range(2)]
    stats = collect_routing(model, batches, channels=True, keep_inputs=1000)
    assert sorted(stats) == [0, 1]
    layer = stats[0]
    assert layer.tokens == 24
    top_k = moe_blocks(model)[0].top_k
    assert float(layer.counts.sum()) == 24 * top_k
    assert torch.allclose(layer.probability.sum(), torch.tensor(24.0))
    # recompute from the captured router inputs (every token kept): the same sums, by hand
    x = layer.inputs
    assert x.shape == (24, model.config.hidden_size)
    weights = ExpertWeights.of(moe_blocks(model)[0])
    index, top = routing(weights, x)
    for expert in range(weights.num_experts):
        token = torch.where(index == expert)[0]
        assert float(layer.counts[expert]) == token.numel()
        torch.testing.assert_close(layer.mass[expert], top[index == expert].sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.input_sq[expert], x[token].pow(2).sum(0), rtol=1e-5, atol=1e-6)
        act = expert_intermediate(weights, expert, x[token])
        torch.testing.assert_close(layer.channel_sq[expert], act.pow(2).sum(0), rtol=1e-5, atol=1e-6)
    assert layer.kept_mass(range(weights.num_experts)) == pytest.approx(1.0)


def test_input_sample_is_bounded():
    model = MOE_FAMILIES["qwen3_moe"]()
    batches = [torch.randint(3, 300, (2, 8)) for _ in range(3)]
    stats = collect_routing(model, batches, keep_inputs=10)
    assert stats[1].inputs.shape[0] == 10
    assert stats[1].input_sq is None and stats[1].channel_sq is None


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_grams_are_the_routing_weighted_activation_grams(family):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family]()
    batches = [torch.randint(3, 300, (2, 6)) for _ in range(2)]
    full = collect_routing(model, batches, channels=True, keep_inputs=1000)
    stats = collect_routing(model, batches, grams=True, layers=[0])
    assert sorted(stats) == [0] and stats[0].channel_sq is None and stats[0].tokens == 24
    gram = stats[0].gram
    weights = ExpertWeights.of(moe_blocks(model)[0])
    assert gram.shape == (weights.num_experts, weights.down.shape[2], weights.down.shape[2])
    x = full[0].inputs
    index, top = routing(weights, x)
    for expert in range(weights.num_experts):
        token, slot = torch.where(index == expert)
        act = expert_intermediate(weights, expert, x[token]) * top[token, slot][:, None]
        torch.testing.assert_close(gram[expert], act.T @ act, rtol=1e-5, atol=1e-6)
    assert torch.equal(stats[0].counts, full[0].counts)


def test_grams_in_chosen_layers_and_the_forward_stops_after_the_deepest_hooked_layer():
    model = MOE_FAMILIES["qwen3_moe"](layers=3)
    batches = [torch.randint(3, 300, (2, 5))]
    seen = []
    handle = moe_blocks(model)[2].router.register_forward_hook(lambda *_: seen.append(2))
    stats = collect_routing(model, batches, channels=True, grams=[1], layers=[0, 1])
    assert sorted(stats) == [0, 1] and seen == []  # layer 2's router never ran
    assert stats[0].gram is None and stats[1].gram is not None and stats[0].channel_sq is not None
    collect_routing(model, batches, grams=True)
    handle.remove()
    assert seen == [2]  # without a layer subset the forward runs through
