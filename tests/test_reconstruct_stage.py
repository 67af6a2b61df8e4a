"""The `reconstruct` stage: least-squares refit of down_proj / o_proj inside `sequential` after pruning."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.layerwise import DenseConsumer
from slimkit.recipes.loading import load_recipe, validate
from slimkit.recipes.runner import run_recipe
from slimkit.recipes.stages.reconstruct import _refit_role, matched_columns
from tests.test_recipes import tiny_recipe
from tests.tiny import model_output, tiny_llama


def test_matched_columns_finds_the_kept_dense_columns_in_order():
    dense = torch.arange(12.0).reshape(2, 6)
    assert matched_columns(dense, dense[:, [0, 3, 5]]).tolist() == [0, 3, 5]
    assert matched_columns(dense, dense).tolist() == list(range(6))
    assert matched_columns(dense, dense[:, [3, 0]]) is None  # out of order: not a pure removal
    assert matched_columns(dense, dense[:, [1]] + 0.5) is None  # changed, not removed
    twins = torch.tensor([[1.0, 1.0, 2.0]])
    assert matched_columns(twins, twins[:, [1, 2]]).tolist() == [0, 2]  # equal columns: the first free one


def _stages(groups, reconstruct: bool, ratio=None):
    prune = {"stage": "prune_layer", "args": {"groups": groups, "scorer": "activation"}}
    if ratio is not None:
        prune["args"]["ratio"] = ratio
    children = [prune] + ([{"stage": "reconstruct"}] if reconstruct else [])
    return [{"sequential": children}]


@pytest.mark.parametrize("groups", [["mlp_channel"], ["attention_head"], ["mlp_channel", "attention_head"]])
def test_reconstruct_lowers_every_refitted_layers_output_error(tmp_path, tiny_llama_dir, groups):
    of = "attention" if groups == ["attention_head"] else "mlp" if groups == ["mlp_channel"] else "layers"
    raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0.3, "of": of, "tolerance": 0.1}, stages=_stages(groups, True))
    report = run_recipe(validate(raw, "t"), raw, tmp_path / "run")
    entry = report["stages"]["reconstruct"]
    roles = {"mlp_channel": "down", "attention_head": "o"}
    assert set(entry["layers"]) == {roles[g] for g in groups}
    for per_layer in entry["layers"].values():
        assert len(per_layer) == 3
        for result in per_layer.values():
            assert result["kept"] < result["of"] and result["method"] == "cholesky"
            assert result["error_after"] < result["error_before"]
    plain = run_recipe(
        validate(raw := tiny_recipe(tiny_llama_dir, target=raw["target"], stages=_stages(groups, False)), "t"),
        raw,
        tmp_path / "plain",
    )
    assert plain["params"]["after"] == report["params"]["after"]  # same structure, only refitted values


def test_reconstruct_leaves_an_unpruned_layer_unchanged(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(
        tiny_llama_dir,
        target={"ratio": 0.0, "of": "mlp", "tolerance": 0.01},
        stages=_stages(["mlp_channel"], True, ratio=0.0),
    )
    report = run_recipe(validate(raw, "t"), raw, tmp_path / "run")
    assert report["stages"]["reconstruct"]["layers"] == {}
    model, _ = slimkit.load(tmp_path / "run" / "model")
    original = slimkit.load(tiny_llama_dir)[0]
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(model_output(model, ids), model_output(original, ids), rtol=0, atol=0)


def test_a_changed_consumer_is_refused_in_one_line():
    model = tiny_llama()
    from slimkit.primitives.arch import ModelView

    layer = ModelView(model).layer(0)
    dense = layer.linear("down").weight.detach().clone()
    stats = {"dense_consumers": {"down": DenseConsumer(dense, torch.eye(dense.shape[1], dtype=torch.float64))}}
    with torch.no_grad():
        layer.linear("down").weight.mul_(2.0)  # same shape: nothing removed, left alone
    assert _refit_role(layer, "down", stats, 1e-6) is None
    layer.linear("down").weight = torch.nn.Parameter(dense[:, :10] * 2.0)  # narrower and changed
    with pytest.raises(SlimkitError, match="columns are not a subset of its dense columns"):
        _refit_role(layer, "down", stats, 1e-6)


def test_the_bundled_recipe_validates():
    recipe, _ = load_recipe("wanda-channels+reconstruct")
    assert [c.stage for c in recipe.stages[0].sequential] == ["prune_layer", "reconstruct"]
