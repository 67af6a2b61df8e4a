"""The ``remove_blocks`` stage on the tiny llama of ``tiny_llama_dir`` (259-token vocabulary: 58,848 parameters; an
attention block holds 6,192, an MLP block 9,264): what it reports, how the one budget counts it, save and reload."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.blocks import removed_blocks
from slimkit.stages.blocks import RemoveBlocksArgs
from tests.recipes.test_recipes import tiny_recipe

DENSE = 58_848
ATTENTION, MLP = 6_192, 9_264


def _recipe(model_dir, ratio: float, stages: list, strict: bool = True) -> dict:
    return tiny_recipe(model_dir, target={"ratio": ratio, "of": "model", "strict": strict}, stages=stages)


@pytest.mark.slow
def test_count_removes_that_many_blocks_reports_each_and_reloads(tmp_path, tiny_llama_dir):
    stages = [{"stage": "remove_blocks", "args": {"count": 2}}]
    result = slimkit.run(_recipe(tiny_llama_dir, 0.2, stages, strict=False), tmp_path / "run", evaluate=False)
    report = result.report.as_json()
    stage = report["stages"]["remove_blocks"]
    steps = stage["details"]["removed"] if "details" in stage else stage["removed"]
    assert len(steps) == 2 and all(step["block"].split(".")[1] in ("attention", "mlp") for step in steps)
    assert [str(b) for b in removed_blocks(result.model)] == sorted(s["block"] for s in steps)
    removed = sum(step["params"] for step in steps)
    assert report["params"]["after"] == DENSE - removed
    assert report["target"]["shares"]["0:remove_blocks"] == pytest.approx(removed / DENSE)
    assert stage["seconds"] is not None and steps[1]["loss"] >= 0
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_without_count_or_ratio_it_solves_the_target(tiny_llama_dir):
    # 10.5% of 58,848 is 6,179 (tolerance 294): one attention block (6,192) lands it, no MLP block fits.
    stages = [{"stage": "remove_blocks"}]
    result = slimkit.run(_recipe(tiny_llama_dir, 0.105, stages), evaluate=False)
    target = result.report.target
    assert target.met and target.achieved == pytest.approx(ATTENTION / DENSE)
    assert [b.kind for b in removed_blocks(result.model)] == ["attention"]


def test_an_explicit_ratio_leaves_the_rest_of_the_budget_to_a_later_stage(tiny_llama_dir):
    stages = [
        {"stage": "remove_blocks", "args": {"ratio": 0.11, "kinds": ["attention"]}},
        {"stage": "prune", "args": {"groups": ["mlp_channel"], "scorer": "magnitude"}},
    ]
    result = slimkit.run(_recipe(tiny_llama_dir, 0.2, stages), evaluate=False)
    target = result.report.target
    assert target.met
    assert target.shares["0:remove_blocks"] == pytest.approx(ATTENTION / DENSE)
    assert target.shares["0:remove_blocks"] + target.shares["1:prune"] == pytest.approx(target.achieved)


def test_the_arguments_declare_their_budget_and_refuse_two_amounts():
    assert RemoveBlocksArgs().budget() == "solve"
    assert RemoveBlocksArgs(count=2).budget() == "explicit" and RemoveBlocksArgs(ratio=0.1).budget() == "explicit"
    with pytest.raises(ValueError, match="count and ratio: give one of them"):
        RemoveBlocksArgs(count=2, ratio=0.1)
    with pytest.raises(ValueError, match="kinds: each kind once"):
        RemoveBlocksArgs(kinds=["mlp", "mlp"])


@pytest.mark.parametrize("stage", ["prune_layer", "obs_prune_layer"])
def test_a_layer_stage_after_removed_mlp_blocks_skips_those_layers_and_lands(tiny_llama_dir, stage):
    args = {"groups": ["mlp_channel"]} | ({"scorer": "activation"} if stage == "prune_layer" else {})
    stages = [
        {"stage": "remove_blocks", "args": {"count": 1, "kinds": ["mlp"]}},
        {"sequential": [{"stage": stage, "args": args}]},
    ]
    result = slimkit.run(_recipe(tiny_llama_dir, 0.25, stages), evaluate=False)
    assert result.report.target.met
    gone = [b.layer for b in removed_blocks(result.model)]
    widths = [layer.mlp_width for layer in ModelView(result.model).layers]
    assert len(gone) == 1 and widths[gone[0]] == 0
    assert all(0 < w < 64 for i, w in enumerate(widths) if i != gone[0])  # every other layer lost channels


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "role"), [("mlp", "down"), ("attention", "o")])
def test_reconstruct_after_removed_blocks_refits_the_other_layers_and_lists_the_removed(tiny_llama_dir, kind, role):
    stages = [
        {"stage": "remove_blocks", "args": {"count": 1, "kinds": [kind]}},
        {
            "sequential": [
                {"stage": "prune_layer", "args": {"groups": ["mlp_channel", "attention_head"], "scorer": "activation"}},
                {"stage": "reconstruct"},
            ]
        },
    ]
    result = slimkit.run(_recipe(tiny_llama_dir, 0.3, stages, strict=False), evaluate=False)
    gone = [b.layer for b in removed_blocks(result.model)]
    details = result.report.stages["reconstruct"].details
    assert len(gone) == 1
    assert details["removed_block"] == {role: gone}
    refitted = {int(i) for i in details["layers"][role]}
    assert refitted == set(range(len(ModelView(result.model).layers))) - set(gone)
