"""Candidate names and one layer's library levels on the tiny llama (6 query heads over 2 KV groups, 64 channels)."""

from __future__ import annotations

import pytest

from slimkit.primitives.blocks import Block, remove_block
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.candidates import CandidateLadder, CandidateSpec, layer_specs
from tests.tiny import tiny_llama


def test_names_round_trip_and_bad_names_are_one_line():
    for part, name in [
        ("mlp", "channels:48"),
        ("attention", "heads:4"),
        ("attention", "lowrank:0.5"),
        ("mlp", "removed"),
    ]:
        assert CandidateSpec.parse(part, name).name == name
    assert CandidateSpec.parse("mlp", "channels:48") == CandidateSpec("mlp", "channels", 48)
    with pytest.raises(SlimkitError, match="channels applies to mlp only"):
        CandidateSpec.parse("attention", "channels:4")
    with pytest.raises(SlimkitError, match="needs a kept count"):
        CandidateSpec.parse("mlp", "channels:half")
    with pytest.raises(SlimkitError, match="out of range"):
        CandidateSpec.parse("attention", "lowrank:1.5")
    with pytest.raises(SlimkitError, match="unknown kind 'prune'"):
        CandidateSpec.parse("mlp", "prune:3")


def test_levels_round_to_the_layers_units_and_drop_repeats():
    model = tiny_llama(layers=2)
    ladder = CandidateLadder(channels=[0.9, 0.5, 0.49], heads=[0.67, 0.5], kv_groups=[0.5], attention_lowrank=[0.5])
    names = [f"{s.part}/{s.name}" for s in layer_specs(model, 0, ladder, {})]
    # heads: 6 * 0.67 = 4.02 -> 4 (2 per KV group), 6 * 0.5 = 3 -> rounded to a multiple of 2 KV groups: 4 again
    assert names == [
        "attention/dense",
        "attention/heads:4",
        "attention/kv_groups:1",
        "attention/lowrank:0.5",
        "attention/removed",
        "mlp/dense",
        "mlp/channels:58",
        "mlp/channels:32",
        "mlp/channels:31",
        "mlp/removed",
    ]
    aligned = [s.name for s in layer_specs(model, 0, ladder, {"mlp_channel": 16}) if s.kind == "channels"]
    assert aligned == ["channels:32"]  # 57.6 -> 64 (the whole width, dropped), 32, 31.4 -> 32 (a repeat)


def test_a_removed_sub_block_has_no_candidates():
    model = tiny_llama(layers=2)
    remove_block(model, Block(1, "mlp"))
    parts = {s.part for s in layer_specs(model, 1, CandidateLadder(), {})}
    assert parts == {"attention"}


def test_the_ladder_refuses_fractions_outside_zero_and_one():
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        CandidateLadder(channels=[1.0])
    assert CandidateLadder(channels=[0.5, 0.75, 0.5]).channels == [0.75, 0.5]
    assert CandidateLadder(heads=[], kv_groups=[], attention_lowrank=[], channels=[], experts=[]).kinds() == {"removed"}
