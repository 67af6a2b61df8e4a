"""The prune stage lands on the target when GQA heads jump over it, and refuses, before scoring, a target its units
cannot meet. Counts of the tiny llama: tests/primitives/select/test_solve_target.py (60,816 parameters; a head step
4,608, an MLP channel step 432)."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine.context import Context
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.stages import prune as prune_module
from slimkit.stages.prune import Prune, PruneArgs
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import tiny_llama


def _context(ratio: float) -> Context:
    model = tiny_llama()
    recipe = slimkit.Recipe(**tiny_recipe("unused", target={"ratio": ratio, "of": "model"}))
    return Context(
        recipe=recipe,
        model=model,
        tokenizer=None,
        source={},
        generator=torch.Generator().manual_seed(0),
        params_before=params_by_part(model),
    )


def test_heads_keep_the_step_below_and_channels_land_the_target():
    ctx = _context(0.10)
    report = Prune().run_model(ctx, PruneArgs(groups=["attention_head", "mlp_channel"], scorer="magnitude")).details
    assert report["fraction_mode"] == "per_kind"
    assert set(report["unit_fraction"]) == {"attention_head", "mlp_channel"}
    achieved = 1 - params_by_part(ctx.model)["total"] / ctx.params_before["total"]
    assert achieved == pytest.approx(6_048 / 60_816)  # 14 channels per layer, every head kept
    assert ctx.recipe.target.met(achieved)


def test_a_shared_fraction_that_lands_is_reported_as_shared():
    ctx = _context(0.20)
    report = Prune().run_model(ctx, PruneArgs(groups=["attention_head", "mlp_channel"], scorer="magnitude")).details
    assert report["fraction_mode"] == "shared"
    assert isinstance(report["unit_fraction"], float)


def test_a_target_the_units_cannot_meet_is_refused_in_one_line_before_scoring(monkeypatch):
    def no_scoring(*args, **kwargs):
        raise AssertionError("scores computed before the refusal")

    monkeypatch.setattr(prune_module, "evaluations", no_scoring)
    monkeypatch.setattr(prune_module, "score_groups", no_scoring)
    ctx = _context(0.10)
    with pytest.raises(SlimkitError) as refused:
        Prune().run_model(ctx, PruneArgs(groups=["attention_head"], scorer="magnitude"))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("prune: groups attention_head (skip_first 0, skip_last 0) cannot remove 10.0% of model")
    assert "nearest plans remove 7.58% or 15.15%" in message  # 10% - (6,082 - 4,608) / 60,816; + (9,216 - 6,082)
    assert "target.tolerance" in message and "skip_first/skip_last" in message
    assert params_by_part(ctx.model) == ctx.params_before  # nothing removed


def test_a_non_strict_target_keeps_the_nearest_shared_plan():
    ctx = _context(0.10)
    ctx.recipe.target.strict = False
    report = Prune().run_model(ctx, PruneArgs(groups=["attention_head"], scorer="magnitude")).details
    assert report["fraction_mode"] == "shared"
    assert not ctx.recipe.target.met(1 - params_by_part(ctx.model)["total"] / ctx.params_before["total"])


def test_a_refusal_names_what_the_stages_before_added():
    """An untied head (what the projection does to a LayerNorm model's tied embedding) adds 300 x 48 = 14,400
    parameters the target then also has to remove; a target beyond what the heads hold names them."""
    from slimkit.primitives.projection import untie_head

    ctx = _context(0.5)
    assert untie_head(ctx.model)
    ctx.start_block()
    with pytest.raises(SlimkitError) as refused:
        Prune().run_model(ctx, PruneArgs(groups=["attention_head"], scorer="magnitude"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("prune: the target needs 44,808 parameters of total removed")
    assert message.endswith("; the stages before it added 14,400 parameters of total to the dense model's 60,816")
