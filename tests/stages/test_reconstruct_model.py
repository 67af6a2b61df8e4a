"""`reconstruct` at the top level: a layer-by-layer refit against the reloaded dense model after a model-scope stage
(stages/reconstruct_model.py)."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine.runner import run
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import load_recipe, validate
from slimkit.stages.reconstruct import ReconstructArgs
from tests.conftest import saved_tiny_llama
from tests.recipes.test_recipes import tiny_recipe
from tests.stages.test_reconstruct_stage import assert_refused_in_one_line
from tests.tiny import model_output

GROUPS = ["mlp_channel", "attention_head"]
LOWRANK_ROLES = "'q'" in str(ReconstructArgs.model_fields["roles"].annotation)
"""reconstruct's roles include q, k, v, gate, up (refitted in sequential as low-rank pairs only)."""
TARGET = {"ratio": 0.3, "of": "layers", "tolerance": 0.1}


def _prune(groups=GROUPS, **args) -> dict:
    return {"stage": "prune", "args": {"groups": list(groups), "scorer": "magnitude", **args}}


def _recipe(model_dir, stages: list, target: dict | None = None) -> dict:
    return tiny_recipe(model_dir, target=target or TARGET, stages=stages)


def _run(raw: dict, out):
    return slimkit.run(raw, out).report.as_json()


def _state(folder) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in slimkit.load(folder)[0].state_dict().items()}


def _weights(folder, index: int) -> dict[str, torch.Tensor]:
    layer = ModelView(slimkit.load(folder)[0]).layer(index)
    return {role: layer.linear(role).weight.detach().clone() for role in ("down", "o")}


@pytest.mark.slow
def test_top_level_reconstruct_lowers_every_layers_error_and_changes_only_down_and_o(tmp_path, tiny_llama_dir):
    report = _run(_recipe(tiny_llama_dir, [_prune(), {"stage": "reconstruct"}]), tmp_path / "refit")
    entry = report["stages"]["reconstruct"]
    assert entry["placement"] == "top level" and entry["dense_model"]["source"] == str(tiny_llama_dir)
    assert entry["settings"] == {"bias": "none", "target": "compressed", "refit": True}
    assert entry["unchanged"] == {"down": [], "o": []}
    for role in ("down", "o"):
        assert sorted(entry["layers"][role]) == ["0", "1", "2"]
        for result in entry["layers"][role].values():
            assert result["kept"] < result["of"] and result["method"] == "cholesky"
            assert result["error_after"] < result["error_before"]
        assert entry["roles"][role]["mean_error_after"] < entry["roles"][role]["mean_error_before"]
    _run(_recipe(tiny_llama_dir, [_prune()]), tmp_path / "plain")
    refit, plain = _state(tmp_path / "refit" / "model"), _state(tmp_path / "plain" / "model")
    assert refit.keys() == plain.keys()
    for name, tensor in plain.items():
        if name.endswith(("down_proj.weight", "o_proj.weight")):
            assert refit[name].shape == tensor.shape and not torch.equal(refit[name], tensor), name
        else:
            assert torch.equal(refit[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("target", ["compressed", "dense"])
def test_with_only_layer_0_pruned_the_top_level_refit_equals_the_in_block_refit(tmp_path, tiny_llama_dir, target):
    """Layer 0 reads the embeddings in both forms and loses the same units (magnitude scores), so the refits agree;
    layers 1 and 2 lost nothing and are reported unchanged. With nothing compressed upstream the dense target is
    the same refit."""
    ratio, settings = 0.25, {"target": target}
    top = _recipe(
        tiny_llama_dir, [_prune(ratio=ratio, skip_last=2), {"stage": "reconstruct", "args": settings}], {"ratio": 0.0}
    )
    top["target"]["strict"] = False
    report = _run(top, tmp_path / "top")
    entry = report["stages"]["reconstruct"]
    assert entry["unchanged"] == {"down": [1, 2], "o": [1, 2]}
    assert {role: sorted(layers) for role, layers in entry["layers"].items()} == {"down": ["0"], "o": ["0"]}
    block = {"sequential": [dict(_prune(ratio=ratio, skip_last=2), stage="prune_layer"), {"stage": "reconstruct"}]}
    block["sequential"][1]["args"] = settings
    inside = _recipe(tiny_llama_dir, [block], {"ratio": 0.0, "strict": False})
    _run(inside, tmp_path / "inside")
    for index in range(3):
        ours, theirs = _weights(tmp_path / "top" / "model", index), _weights(tmp_path / "inside" / "model", index)
        for role in ("down", "o"):
            assert ours[role].shape == theirs[role].shape
            torch.testing.assert_close(ours[role], theirs[role], rtol=1e-5, atol=1e-6)
    original = _weights(tiny_llama_dir, 0)
    assert _weights(tmp_path / "top" / "model", 0)["down"].shape[1] < original["down"].shape[1]


@pytest.mark.slow
def test_the_dense_target_differs_downstream_of_refitted_layers(tmp_path, tiny_llama_dir):
    weights = {}
    for target in ("compressed", "dense"):
        raw = _recipe(tiny_llama_dir, [_prune(), {"stage": "reconstruct", "args": {"target": target}}])
        assert _run(raw, tmp_path / target)["stages"]["reconstruct"]["settings"]["target"] == target
        weights[target] = [_weights(tmp_path / target / "model", i) for i in range(3)]
    for role in ("down", "o"):
        torch.testing.assert_close(weights["dense"][0][role], weights["compressed"][0][role], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(weights["dense"][2][role], weights["compressed"][2][role], rtol=1e-3, atol=1e-5)


def test_the_saved_model_loads_with_the_logits_it_had_in_memory(tmp_path, tiny_llama_dir):
    raw = _recipe(tiny_llama_dir, [_prune(), {"stage": "reconstruct", "args": {"bias": "mean"}}])
    result = run(validate(raw, "t"), tmp_path / "run")
    assert result.model.config.mlp_bias and result.model.config.attention_bias
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(model_output(loaded, ids), model_output(result.model, ids), rtol=0, atol=0)


@pytest.mark.slow
def test_a_role_with_nothing_removed_is_flagged_when_another_was_refitted(tmp_path, tiny_llama_dir):
    # As LLM-Pruner at 10% (MLP channels, no heads): roles [down, o] refits down and names o in the report.
    target = {"ratio": 0.25, "of": "mlp", "tolerance": 0.05}
    raw = _recipe(tiny_llama_dir, [_prune(["mlp_channel"]), {"stage": "reconstruct", "args": {"roles": ["down", "o"]}}])
    raw["target"] = target
    report = _run(raw, tmp_path / "run")
    entry = report["stages"]["reconstruct"]
    assert set(entry["layers"]) == {"down"} and entry["not_refitted"] == ["o"]
    assert any(note.startswith("reconstruct: o refitted in no layer") for note in report["notes"])


def test_a_model_given_in_memory_is_refused_in_one_line(tiny_llama_dir):
    raw = _recipe(tiny_llama_dir, [_prune(), {"stage": "reconstruct"}])
    model, tokenizer = slimkit.load(tiny_llama_dir)
    with pytest.raises(SlimkitError, match=r"^reconstruct: the top-level form reloads the recipe's model source") as e:
        run(validate(raw, "t"), model=model, tokenizer=tokenizer)
    assert "\n" not in str(e.value) and "given in memory" in str(e.value)


BAD = [
    ("first", [{"stage": "reconstruct"}], {"ratio": 0.0}, "reconstruct is the first stage of the recipe"),
    (
        "after-a-block",
        [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "magnitude"}}]}, {"stage": "reconstruct"}],
        {"ratio": 0.25, "of": "mlp", "tolerance": 0.05},
        "reconstruct runs inside sequential, after the stage that removes units: move it to the end of the "
        "sequential block at stages.0",
    ),
    (
        "role-not-removed",
        [_prune(["mlp_channel"]), {"stage": "reconstruct", "args": {"roles": ["o"]}}],
        {"ratio": 0.25, "of": "mlp", "tolerance": 0.05},
        "reconstruct: roles asks to refit o, but no stage before it removed the units o reads (attention heads) in "
        "any layer",
    ),
    (
        "nothing-removed",
        [_prune(ratio=0.0), {"stage": "reconstruct"}],
        {"ratio": 0.0},
        "reconstruct: no stage before it removed the units down reads (MLP channels) or o reads (attention heads)",
    ),
    (
        "hidden-features",
        [_prune(["hidden_feature"]), {"stage": "reconstruct"}],
        {"ratio": 0.2, "of": "model", "tolerance": 0.1},
        "reconstruct: the model's hidden size is",
    ),
    (
        "low-rank",
        [
            {"stage": "lowrank", "args": {"roles": ["o"], "method": "svd", "allocation": "uniform", "ratio": 0.3}},
            _prune(["mlp_channel"], ratio=0.3),
            {"stage": "reconstruct"},
        ],
        {"ratio": 0.2, "of": "layers", "strict": False},
        "reconstruct: layer 0 o is a low-rank pair, which the top-level form does not refit",
    ),
    (
        "other-roles",
        [_prune(), {"stage": "reconstruct", "args": {"roles": ["down", "q"]}}],
        TARGET,
        "reconstruct: at the top level it refits down and o (after units were removed), not q",
    ),
]


@pytest.mark.parametrize(("case", "stages", "target", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_refusals_are_one_line_and_write_nothing(case, stages, target, fragment, monkeypatch, capsys, tmp_path):
    from tests.tiny import byte_tokenizer

    if case == "other-roles" and not LOWRANK_ROLES:
        pytest.skip("reconstruct's roles are down and o only")
    folder = saved_tiny_llama(tmp_path / "model", byte_tokenizer())
    assert_refused_in_one_line(_recipe(folder, stages, target), fragment, monkeypatch, capsys, tmp_path)


@pytest.mark.parametrize("name", ["llm-pruner+reconstruct", "cce+reconstruct"])
def test_the_bundled_recipes_put_reconstruct_at_the_top_level(name):
    recipe, _ = load_recipe(name)
    stages = [getattr(item, "stage", "sequential") for item in recipe.stages]
    assert stages == [stages[0], "reconstruct", "lora"] and stages[0] in ("prune", "cce")
    args = recipe.stages[1].parsed_args()
    assert args.roles == ["down", "o"] and args.toward == "kept" and args.damping == 0.1
    if name == "cce+reconstruct":
        assert "hidden_feature" not in recipe.stages[0].parsed_args().kinds
