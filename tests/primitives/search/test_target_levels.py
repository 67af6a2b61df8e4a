"""Levels solved from the target for uniform layers, on numbers and on the tiny llama (hidden 48, 64 MLP channels of
3 x 48 = 144 parameters each; 6 query heads of 8 over 2 KV groups: q and o hold 48 x 8 = 384 parameters per head)."""

from __future__ import annotations

from slimkit.primitives.search.build import BuildSettings
from slimkit.primitives.search.candidates import CandidateLadder, CandidateSpec, layer_specs
from slimkit.primitives.search.target_levels import (
    kept_fraction_for,
    kept_units_for,
    layer_shape,
    layer_shares,
    partner_specs,
    shape_removal,
    with_target_levels,
)
from tests.tiny import tiny_llama

SETTINGS = BuildSettings()


def test_kept_units_lie_on_either_side_of_the_solution_at_the_multiple():
    assert kept_units_for(300, 10, 100) == [7]  # 10 - 300 / 100, exactly
    assert kept_units_for(250, 10, 100) == [8, 7]  # 7.5
    assert kept_units_for(300, 10, 100, multiple=4) == [8, 4]
    assert kept_units_for(0, 10, 100) == []  # nothing to remove: the parent
    assert kept_units_for(950, 10, 100) == [1]  # 0.5: keeping none is not a level
    assert kept_units_for(2000, 10, 100) == []


def test_kept_fraction_is_what_is_left_and_none_outside_zero_and_one():
    assert kept_fraction_for(250, 1000) == 0.75
    assert kept_fraction_for(1 / 3 * 1000, 1000) == 0.6667
    assert kept_fraction_for(1000, 1000) is None
    assert kept_fraction_for(-5, 1000) is None


def test_shape_removal_counts_the_candidates_parameters_and_leaves_the_model():
    model = tiny_llama(layers=2)
    before = {name: p.shape for name, p in model.named_parameters()}
    assert shape_removal(model, 0, CandidateSpec("mlp", "channels", 63), "total", SETTINGS) == 144
    assert shape_removal(model, 0, CandidateSpec("attention", "heads", 4), "total", SETTINGS) == 2 * 2 * 384
    assert shape_removal(model, 0, CandidateSpec("attention", "heads", 4), "mlp", SETTINGS) == 0
    assert {name: p.shape for name, p in model.named_parameters()} == before


def test_each_attention_level_gets_the_channel_counts_that_land_the_layer_on_its_share():
    model = tiny_llama(layers=2)
    ladder = CandidateLadder(heads=[0.67], kv_groups=[], attention_lowrank=[], channels=[0.5], remove_attention=False)
    specs = layer_specs(model, 0, ladder, {})
    solved = partner_specs(model, 0, specs, 3000, {}, "total", SETTINGS)
    # dense attention: 64 - 3000 / 144 = 43.2 channels kept; heads:4 removes 1,536, so 64 - 1,464 / 144 = 53.8
    added = [s.name for s in solved[len(specs) :]]
    assert added == ["channels:54", "channels:53", "channels:44", "channels:43"]
    assert solved[: len(specs)] == specs


def test_each_mlp_level_gets_the_low_rank_attention_that_lands_the_layer_on_its_share():
    model = tiny_llama(layers=2)
    ladder = CandidateLadder(heads=[], kv_groups=[], attention_lowrank=[0.5], channels=[0.5], remove_mlp=False)
    specs = layer_specs(model, 0, ladder, {})
    solved = partner_specs(model, 0, specs, 2000, {}, "total", SETTINGS)
    added = [s for s in solved if s not in specs and s.part == "attention"]
    # dense MLP: the attention removes the 2,000 alone; channels:32 removes 4,608, more than the share (no partner)
    assert [s.kind for s in added] == ["lowrank"]
    (lowrank,) = added
    rank_step = 48 + 48  # one rank of a 48 x 48 factor pair
    assert abs(shape_removal(model, 0, lowrank, "total", SETTINGS) - 2000) <= rank_step


def test_layers_of_one_shape_get_the_same_names_and_untied_layers_none():
    model = tiny_llama(layers=3)
    ladder = CandidateLadder(heads=[0.67], kv_groups=[], attention_lowrank=[], channels=[0.5])
    specs = {i: layer_specs(model, i, ladder, {"mlp_channel": 8}) for i in range(3)}
    shares = layer_shares(model, specs, 9000, "total")
    assert sorted(shares.values()) == [3000, 3000, 3000]
    solved = with_target_levels(model, specs, ["attention", "mlp"], 9000, {"mlp_channel": 8}, "total", SETTINGS)
    names = [[s.name for s in solved[i]] for i in range(3)]
    assert names[0] == names[1] == names[2]
    assert {s.kept for s in solved[0] if s.kind == "channels"} == {32, 40, 48, 56}  # 43.2 and 53.8 at multiples of 8
    assert with_target_levels(model, specs, ["mlp"], 9000, {}, "total", SETTINGS) == specs  # attention is free


def test_layers_of_one_shape_are_probed_once(monkeypatch):
    import slimkit.primitives.search.target_levels as target_levels

    model = tiny_llama(layers=3)
    ladder = CandidateLadder(heads=[0.67], kv_groups=[], attention_lowrank=[], channels=[0.5])
    specs = {i: layer_specs(model, i, ladder, {}) for i in range(3)}
    expected = {i: partner_specs(model, i, specs[i], 3000, {}, "total", SETTINGS) for i in range(3)}
    probed: list[int] = []
    solve = target_levels.partner_specs
    monkeypatch.setattr(target_levels, "partner_specs", lambda m, i, *rest: probed.append(i) or solve(m, i, *rest))
    assert with_target_levels(model, specs, ["attention", "mlp"], 9000, {}, "total", SETTINGS) == expected
    assert probed == [0]
    # a narrower gate in layer 2 makes it another shape
    model.model.layers[2].mlp.gate_proj.weight.data = model.model.layers[2].mlp.gate_proj.weight.data[:32]
    assert layer_shape(model, 2) != layer_shape(model, 0) == layer_shape(model, 1)
