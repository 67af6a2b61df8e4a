"""FLAP's global ranking: per-group standardised scores on one scale, landing on a number of parameters removed."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.allocate import UnitCosts, global_ranking, standardize, total_removed, unit_costs
from slimkit.primitives.groups import build_groups
from slimkit.primitives.select.plan import SelectionRules, TargetOutOfReach
from tests.tiny import tiny_llama


def test_standardize_is_zero_mean_unit_spread_and_zero_without_spread():
    z = standardize(torch.tensor([1.0, 2.0, 3.0, 10.0]))
    assert float(z.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(z.std()) == pytest.approx(1.0)
    assert torch.equal(standardize(torch.full((5,), 3.0)), torch.zeros(5, dtype=torch.float64))


def _skewed_scores() -> list[torch.Tensor]:
    """Three groups of 64 units: a few very low outliers (0), uniform (1), a few very high outliers (2)."""
    generator = torch.Generator().manual_seed(0)
    base = torch.rand(64, generator=generator) + 1.0
    low = base.clone()
    low[:8] = -20.0  # eight units far below the rest
    high = base.clone()
    high[:8] = 30.0
    return [low, base, high]


def test_lands_on_the_wanted_removal_with_non_uniform_aligned_counts():
    costs = [UnitCosts("mlp_channel", layer, 64, 144, multiple=8) for layer in range(3)]
    wanted = 64 * 3 * 144 // 4  # a quarter of the units
    kept = global_ranking(_skewed_scores(), costs, wanted, tolerance=144 * 4)
    assert abs(total_removed(costs, kept) - wanted) <= 144 * 4
    assert all(k % 8 == 0 for k in kept)
    assert len(set(kept)) > 1  # not uniform
    # Layer 0's eight low outliers stand far below its other units (z -2.6 against 0.3 and up): it loses exactly
    # those; layer 2's high outliers squeeze its other units together near z -0.4, where the threshold falls.
    assert kept[0] == 56 and kept[2] < 64


def test_each_unit_is_priced_by_its_parameters():
    """Two groups with the same score spread lose the same units; the budget counts each at its own price."""
    scores = [torch.linspace(0, 1, 64), torch.linspace(0, 1, 64)]
    cheap, dear = UnitCosts("mlp_channel", 0, 64, 100), UnitCosts("attention_head", 0, 64, 800)
    kept = global_ranking(scores, [cheap, dear], wanted=16 * (100 + 800), tolerance=0)
    assert kept == [48, 48]


def test_min_keep_and_multiples_are_honoured_at_a_large_budget():
    costs = [UnitCosts("mlp_channel", layer, 64, 10, multiple=16, minimum=20) for layer in range(2)]
    kept = global_ranking([torch.rand(64), torch.rand(64)], costs, wanted=2 * 32 * 10, tolerance=0)
    assert kept == [32, 32]
    with pytest.raises(TargetOutOfReach) as miss:
        global_ranking([torch.rand(64), torch.rand(64)], costs, wanted=2 * 40 * 10, tolerance=0)
    assert miss.value.below == 2 * 32 * 10 and miss.value.above is None


def test_an_unreachable_tolerance_names_the_nearest_removals():
    costs = [UnitCosts("mlp_channel", 0, 64, 10, multiple=16)]
    with pytest.raises(TargetOutOfReach) as miss:
        global_ranking([torch.rand(64)], costs, wanted=200, tolerance=5)
    assert (miss.value.below, miss.value.above) == (160, 320)


def test_unit_costs_of_the_tiny_llama_follow_the_rules():
    model = tiny_llama()
    groups = build_groups(model, "mlp_channel", [0, 1]) + build_groups(model, "attention_head", [0])
    rules = SelectionRules(round_to={"mlp_channel": 16})
    costs = unit_costs(model, groups, rules, "model", max_fraction=0.5)
    assert [c.unit_params for c in costs] == [144, 144, 2 * 8 * 48]  # gate/up rows + down column; q rows + o cols
    assert [c.multiple for c in costs] == [16, 16, 2]  # heads: one per KV group (2 KV groups)
    assert [c.minimum for c in costs] == [32, 32, 3]  # max_fraction 0.5 of 64 channels / 6 heads
