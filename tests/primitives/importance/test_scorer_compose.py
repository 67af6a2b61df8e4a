"""Scorer compositions (primitives/importance/compose.py): parsing, blends, PLATON, means over evaluations."""

from __future__ import annotations

import re

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.importance import SCORERS, register_scorer, score_group, scorer_def
from slimkit.primitives.importance.compose import (
    Blend,
    Named,
    Smoothed,
    describe,
    parse_scorer,
    score_groups,
    spec_kinds,
    spec_needs,
    spec_smooths,
)
from tests.primitives.importance.test_importance_select import TwoLayerMLP, mlp_group

NORMS = {"input_norms": {"up": torch.tensor([1.0, 2.0]), "down": torch.tensor([3.0, 1.0, 2.0])}}


def test_parse_names_platon_and_blends():
    assert parse_scorer("activation") == Named("activation")
    assert parse_scorer({"platon": "coupled", "x1": 0.25}) == Smoothed(Named("coupled"), 0.25, 0.5)
    blend = parse_scorer({"blend": {"activation": 1, "taylor": 3}})
    assert blend == Blend(((Named("activation"), 1.0), (Named("taylor"), 3.0)))
    as_list = parse_scorer({"blend": [{"scorer": "activation", "weight": 1}, {"scorer": "taylor", "weight": 3}]})
    assert as_list == blend
    nested = parse_scorer({"blend": [{"scorer": {"platon": "magnitude"}, "weight": 1}]})
    assert spec_smooths(nested) and not spec_smooths(blend)
    assert spec_needs(blend) == {"input_norms", "gradients"} and spec_needs(Named("random")) == set()
    assert spec_kinds(parse_scorer({"blend": {"coupled": 1, "magnitude": 1}})) == set(scorer_def("coupled").kinds)
    assert describe(blend) == "blend(1 activation + 3 taylor)" and describe(nested) == "blend(1 platon(magnitude))"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("activaton", "unknown scorer 'activaton'; did you mean 'activation'?"),
        ({"platon": "magnitude", "x1": 1.0}, "x1 must be a number in [0, 1)"),
        ({"platon": {"platon": "magnitude"}}, "smoothed already"),
        ({"platon": "magnitude", "decay": 0.5}, "unknown field 'decay'"),
        ({"blend": {"magnitude": 0}}, "weights must be positive"),
        ({"blend": {}}, "at least one scorer"),
        ({"blend": {"magnitude": 1}, "x1": 0.5}, "one field 'blend'"),
        (3, "expected a scorer name"),
    ],
)
def test_bad_scorer_specs_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_scorer(value)


def test_a_blend_sums_mean_normalised_parts_by_hand():
    model, group = TwoLayerMLP(), mlp_group()
    # magnitude l1 [4, 8, 4] (mean 16/3) and activation l1 [8, 12, 8] (mean 28/3), see test_importance_select
    [scores] = score_groups(
        parse_scorer({"blend": {"magnitude": 1, "activation": 2}}), [group], model, [NORMS], aggregation="l1"
    )
    expected = torch.tensor([0.75, 1.5, 0.75]) + 2 * torch.tensor([6 / 7, 9 / 7, 6 / 7])
    torch.testing.assert_close(scores, expected)
    # a blend of one part ranks exactly as the part (scaled by its mean)
    [alone] = score_groups(parse_scorer({"blend": {"activation": 5}}), [group], model, [NORMS], aggregation="l1")
    torch.testing.assert_close(alone, 5 * torch.tensor([8.0, 12.0, 8.0]) / (28 / 3))


def test_platon_over_two_evaluations_by_hand():
    model, group = TwoLayerMLP(), mlp_group()
    # I = [4, 8, 4] twice: S = I_bar(1) U_bar(1) + I_bar(2) U_bar(2) = [2, 8, 2] + [3, 12, 3]
    [scores] = score_groups(parse_scorer({"platon": "magnitude"}), [group], model, [{}, {}], aggregation="l1")
    torch.testing.assert_close(scores, torch.tensor([5.0, 20.0, 5.0]), check_dtype=False)


def test_a_plain_scorer_averages_its_evaluations():
    model, group = TwoLayerMLP(), mlp_group()
    doubled = {"input_norms": {k: 3 * v for k, v in NORMS["input_norms"].items()}}
    [scores] = score_groups(Named("activation"), [group], model, [NORMS, doubled], aggregation="l1")
    torch.testing.assert_close(scores, 2 * torch.tensor([8.0, 12.0, 8.0]))  # mean of x1 and x3


def test_score_group_checks_kind_and_statistics():
    model, group = TwoLayerMLP(), mlp_group()
    with pytest.raises(SlimkitError, match="scorer activation needs the statistics input_norms"):
        score_group("activation", group, model, {"input_norm": {}})
    with pytest.raises(SlimkitError, match="unknown scorer 'magnitud'; did you mean 'magnitude'"):
        score_group("magnitud", group, model, {})


def test_a_registered_scorer_is_usable_by_name_everywhere():
    @register_scorer("test-ones")
    def ones(group, model, stats, **_):
        """Every unit scores 1."""
        return torch.ones(group.size)

    try:
        model, group = TwoLayerMLP(), mlp_group()
        assert parse_scorer("test-ones") == Named("test-ones")
        [scores] = score_groups(parse_scorer({"blend": {"test-ones": 1, "magnitude": 1}}), [group], model, [{}])
        assert scores.shape == (3,)
        with pytest.raises(ValueError, match="registered twice"):
            register_scorer("test-ones")(ones)
    finally:
        SCORERS.pop("test-ones")
