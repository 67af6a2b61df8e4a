"""The select package's public API: plan names exported from the package, part names of solve_fraction."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import slimkit.primitives.select as select
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.groups import build_groups
from slimkit.primitives.select import SelectionRules, check_shapes, kept_counts, plan, solve_fraction
from slimkit.primitives.select.plan import PART_NAMES, removed_params


def test_plan_api_is_exported_with_docstrings():
    for name in ("plan", "SelectionRules", "solve_fraction", "kept_counts", "check_shapes"):
        assert name in select.__all__
        assert getattr(select, name).__doc__
    assert select.plan.__module__ == "slimkit.primitives.select.plan"


@pytest.mark.slow
@pytest.mark.parametrize(
    "first", ["slimkit.primitives.select.plan", "slimkit.primitives.select.iterative", "slimkit.primitives.select"]
)
def test_no_import_cycle_whichever_module_comes_first(first):
    code = f"import {first}; from slimkit.primitives.select import plan, keep_top, solve_fraction"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


@pytest.mark.parametrize(("target", "count"), [("model", "total"), ("layers", "layers"), ("mlp", "mlp")])
def test_solve_fraction_takes_recipe_target_and_count_names(llama, target, count):
    groups = build_groups(llama, "mlp_channel")
    scores = [torch.rand(g.size) for g in groups]
    wanted = round(0.2 * params_by_part(llama)["mlp"])
    by_target = solve_fraction(llama, groups, scores, SelectionRules(), target, wanted)
    assert by_target == solve_fraction(llama, groups, scores, SelectionRules(), count, wanted)
    counts = kept_counts(groups, scores, by_target, SelectionRules())
    assert [k.numel() for k in plan(groups, scores, by_target, SelectionRules())] == counts
    check_shapes(groups, SelectionRules())


def test_attention_target_counts_head_parameters(llama):
    heads = build_groups(llama, "attention_head")
    scores = [torch.rand(g.size) for g in heads]
    fraction = solve_fraction(llama, heads, scores, SelectionRules(), "attention", 3 * 2 * 2 * 8 * 48)
    assert kept_counts(heads, scores, fraction, SelectionRules()) == [4, 4, 4]  # 2 of 6 heads per layer
    assert {"model", "total", "embeddings", "norms", "head", "other"} <= set(PART_NAMES)


@pytest.mark.parametrize("part", ["Model", "params", "", "hidden"])
def test_unknown_part_names_fail_with_the_allowed_ones(llama, part):
    groups = build_groups(llama, "mlp_channel")
    scores = [torch.rand(g.size) for g in groups]
    with pytest.raises(SlimkitError, match=r"unknown part .*allowed: recipe targets model, layers, mlp, attention"):
        solve_fraction(llama, groups, scores, SelectionRules(), part, 10)
    with pytest.raises(SlimkitError, match="parameter counts total, layers, embeddings"):
        removed_params(llama, groups, [g.size for g in groups], part, {})
