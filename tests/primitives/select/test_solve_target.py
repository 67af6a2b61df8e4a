"""solve_target: one shared fraction where it lands, one per kind where GQA heads jump over the target.

Tiny llama (tests/tiny.py): 3 layers, 6 query heads over 2 KV heads of 8, hidden 48, MLP 64, 300-token tied
embeddings: 60,816 parameters. One head step (a query head per KV group, in every layer) removes
3 x 2 x (8 x 48 q + 48 x 8 o) = 4,608 parameters (7.6%); one MLP channel in every layer 3 x 3 x 48 = 432.
"""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.evaluate.counting import param_parts, params_by_part
from slimkit.primitives.groups import build_groups
from slimkit.primitives.select import SelectionRules, TargetOutOfReach, kept_counts, solve_fraction, solve_target
from slimkit.primitives.select.plan import removed_params
from tests.tiny import tiny_llama

TOTAL = 60_816


def _groups(model, kinds):
    groups = [g for kind in kinds for g in build_groups(model, kind)]
    return groups, [torch.zeros(g.size) for g in groups]


def test_the_tiny_shape_is_as_the_docstring_counts():
    model = tiny_llama()
    assert params_by_part(model)["total"] == TOTAL
    heads, _ = _groups(model, ["attention_head"])
    assert removed_params(model, heads, [4, 4, 4], "model", param_parts(model)) == 4_608


def test_a_head_step_over_the_target_is_split_per_kind_and_lands():
    model = tiny_llama()
    groups, scores = _groups(model, ["attention_head", "mlp_channel"])
    wanted, tolerance = round(0.10 * TOTAL), round(0.005 * TOTAL)  # 6,082 within 304
    shared = solve_fraction(model, groups, scores, SelectionRules(), "model", wanted)
    missed = removed_params(
        model, groups, kept_counts(groups, scores, shared, SelectionRules()), "model", param_parts(model)
    )
    assert abs(missed - wanted) > tolerance  # 11 channels (7.8%) or 11 channels + a head step (15.4%)
    fraction = solve_target(model, groups, scores, SelectionRules(), "model", wanted, tolerance)
    assert isinstance(fraction, dict) and set(fraction) == {"attention_head", "mlp_channel"}
    counts = kept_counts(groups, scores, fraction, SelectionRules())
    assert counts == [6, 6, 6, 50, 50, 50]  # heads at the step below the target; 14 channels: 14 x 432 = 6,048
    assert removed_params(model, groups, counts, "model", param_parts(model)) == 6_048


def test_a_target_no_plan_of_the_units_reaches_is_refused_with_the_nearest():
    model = tiny_llama()
    heads, scores = _groups(model, ["attention_head"])
    with pytest.raises(TargetOutOfReach) as miss:
        solve_target(model, heads, scores, SelectionRules(), "model", round(0.10 * TOTAL), round(0.005 * TOTAL))
    assert (miss.value.wanted, miss.value.below, miss.value.above) == (6_082, 4_608, 9_216)  # one or two steps


def test_a_shared_fraction_that_lands_is_returned_unchanged():
    model = tiny_llama()
    groups, scores = _groups(model, ["attention_head", "mlp_channel"])
    wanted = round(0.2 * TOTAL)
    shared = solve_fraction(model, groups, scores, SelectionRules(), "model", wanted)
    assert solve_target(model, groups, scores, SelectionRules(), "model", wanted, round(0.005 * TOTAL)) == shared
