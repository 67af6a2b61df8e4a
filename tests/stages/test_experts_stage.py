"""The ``prune_experts`` / ``merge_experts`` stages on tiny MoE folders of each family: the one target lands, the
report lists kept experts and routing mass per layer, the result reloads with equal logits."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import load_recipe
from slimkit.stages.experts import ExpertMergeArgs, ExpertPruneArgs
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import MOE_FAMILIES, byte_tokenizer


def _folder(tmp_path, family: str, experts: int = 6):
    torch.manual_seed(0)
    model = MOE_FAMILIES[family](vocab_size=259, experts=experts, top_k=2)
    path = tmp_path / family
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _expert_share(model) -> float:
    """One expert's parameters (fused slices and router row) as a share of the MLP parameters."""
    block = moe_blocks(model)[0]
    mlp = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    return block.expert_params() / mlp


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_prune_experts_lands_the_target_and_reloads(tmp_path, family):
    folder = _folder(tmp_path, family)
    dense, _ = slimkit.load(folder)
    ratio = 2 * len(moe_blocks(dense)) * _expert_share(dense)  # two experts of every layer
    recipe = tiny_recipe(folder, target={"ratio": round(ratio, 4), "of": "mlp"}, stages=[{"stage": "prune_experts"}])
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    assert result.report.target.met
    stage = result.report.as_json()["stages"]["prune_experts"]
    details = stage.get("details", stage)
    assert details["experts_kept"] == [4, 4]
    assert all(len(layer["kept"]) == 4 and 0 < layer["kept_mass"] <= 1 for layer in details["layers"])
    assert all(layer["exhaustive"] and layer["candidates"] == 15 for layer in details["layers"])  # C(6, 4)
    reloaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["frequency", "naee"])
def test_global_allocation_lands_within_one_expert(tmp_path, scorer):
    folder = _folder(tmp_path, "qwen3_moe", experts=8)
    dense, _ = slimkit.load(folder)
    ratio = 5 * _expert_share(dense)  # five experts over two layers: counts must differ
    stages = [{"stage": "prune_experts", "args": {"allocation": "global", "scorer": scorer}}]
    recipe = tiny_recipe(folder, target={"ratio": round(ratio, 4), "of": "mlp"}, stages=stages)
    result = slimkit.run(recipe, evaluate=False)
    assert result.report.target.met
    assert sorted(b.num_experts for b in moe_blocks(result.model)) in ([3, 8], [4, 7], [5, 6])
    assert any("different expert counts" in note for note in result.report.notes)


def test_merge_experts_lands_the_target_and_reloads(tmp_path):
    folder = _folder(tmp_path, "qwen2_moe")
    dense, _ = slimkit.load(folder)
    ratio = 2 * len(moe_blocks(dense)) * _expert_share(dense)
    recipe = tiny_recipe(folder, target={"ratio": round(ratio, 4), "of": "mlp"}, stages=[{"stage": "merge_experts"}])
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    assert result.report.target.met
    stage = result.report.as_json()["stages"]["merge_experts"]
    details = stage.get("details", stage)
    assert all(sum(len(v) for v in layer["merged"].values()) == 2 for layer in details["layers"])
    reloaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)


def test_refusals_are_one_line_before_calibration(tmp_path):
    folder = _folder(tmp_path, "mixtral", experts=4)
    model, _ = slimkit.load(folder)
    with pytest.raises(SlimkitError, match="keep 1 is outside layer 0's 2-4"):
        ExpertPruneArgs(keep=1).check_model(model)
    recipe = tiny_recipe(
        folder, target={"ratio": 0.9, "of": "mlp", "strict": False}, stages=[{"stage": "prune_experts"}]
    )
    with pytest.raises(SlimkitError, match="more than the 2 a layer can lose"):
        slimkit.run(recipe, evaluate=False)
    from tests.tiny import tiny_llama

    with pytest.raises(SlimkitError, match="no routed experts"):
        ExpertPruneArgs().check_model(tiny_llama())


def test_args_declare_their_budget_and_the_bundled_recipes_validate():
    assert ExpertPruneArgs().budget() == "solve" and ExpertPruneArgs(keep=4).budget() == "explicit"
    assert ExpertMergeArgs().scorer == "frequency"
    for name in ("moe-expert-prune", "moe-expert-merge"):
        recipe, _ = load_recipe(name)
        assert recipe.stages[0].stage in ("prune_experts", "merge_experts")


def test_stages_that_change_mlp_projections_are_refused_on_moe_models(tmp_path):
    folder = _folder(tmp_path, "qwen3_moe")
    stages = [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}]
    with pytest.raises(SlimkitError, match="holds its MLP as routed experts"):
        slimkit.run(tiny_recipe(folder, stages=stages), tmp_path / "out", evaluate=False)
    assert not (tmp_path / "out").exists()
    olmoe = _folder(tmp_path, "olmoe")
    heads = [{"stage": "prune", "args": {"groups": ["attention_head"], "scorer": "magnitude"}}]
    recipe = tiny_recipe(olmoe, target={"ratio": 0.2, "of": "attention"}, stages=heads)
    with pytest.raises(SlimkitError, match="q/k norms act on the whole projection"):
        slimkit.run(recipe, evaluate=False)


def test_experts_then_expert_channels_land_the_target_and_reload(tmp_path):
    folder = _folder(tmp_path, "qwen3_moe", experts=8)
    dense, _ = slimkit.load(folder)
    block = moe_blocks(dense)[0]
    mlp_layer = 8 * block.expert_params()
    removed = 2 * block.expert_params() + 6 * 3 * 32 * 8  # two experts, then 8 of the 16 channels of the other 6
    stages = [
        {"stage": "prune_experts", "args": {"ratio": 0.25, "scorer": "frequency"}},
        {"stage": "prune_expert_channels", "args": {"shared": True}},
    ]
    recipe = tiny_recipe(folder, target={"ratio": round(removed / mlp_layer, 4), "of": "mlp"}, stages=stages)
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    assert result.report.target.met
    assert [(b.num_experts, b.width) for b in moe_blocks(result.model)] == [(6, 8), (6, 8)]
    stage = result.report.as_json()["stages"]["prune_expert_channels"]
    assert stage.get("details", stage)["widths"] == [8, 8]
    reloaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)


def test_the_hybrid_recipe_validates_and_ratio_and_keep_exclude_each_other():
    recipe, _ = load_recipe("moe-expert-prune+channels")
    assert [s.stage for s in recipe.stages] == ["prune_experts", "prune_expert_channels"]
    assert ExpertPruneArgs(ratio=0.25).budget() == "explicit"
    with pytest.raises(ValueError, match="keep and ratio"):
        ExpertPruneArgs(keep=4, ratio=0.25)


def test_a_removed_moe_block_saves_as_zero_experts_and_reloads(tmp_path):
    folder = _folder(tmp_path, "qwen3_moe", experts=8)
    stages = [{"stage": "remove_blocks", "args": {"count": 1, "kinds": ["mlp"]}}]
    recipe = tiny_recipe(folder, target={"ratio": 0.5, "of": "mlp", "strict": False}, stages=stages)
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    assert len(moe_blocks(result.model)) == 1
    reloaded, _ = slimkit.load(tmp_path / "run" / "model")
    assert len(moe_blocks(reloaded)) == 1
    ids = torch.randint(3, 259, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)
