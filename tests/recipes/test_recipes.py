"""Recipe schema, overrides, bundled recipes, and an end-to-end run on a tiny local model."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import apply_override, bundled_recipes, load_recipe, validate


def tiny_recipe(model_dir, **changes) -> dict:
    recipe = {
        "name": "tiny-wanda",
        "model": str(model_dir),
        "seed": 0,
        "calibration": {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2},
        "target": {"ratio": 0.25, "of": "mlp"},
        "stages": [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}],
        "eval": {"perplexity": {"datasets": ["wikitext2"], "seq_len": 32, "max_tokens": 128}},
    }
    recipe.update(changes)
    return recipe


def test_bundled_recipes_validate():
    names = set(bundled_recipes())
    assert {"wanda-channels", "magnitude", "random"} <= names
    for name in names:
        recipe, _ = load_recipe(name)
        assert recipe.name == name


def test_overrides_by_dotted_path():
    data = {"target": {"ratio": 0.2}, "stages": [{"stage": "prune_layer", "args": {}}]}
    apply_override(data, "target.ratio=0.3")
    apply_override(data, "stages.0.args.scorer=magnitude")
    apply_override(data, "eval.zeroshot=null")
    assert data["target"]["ratio"] == 0.3 and data["stages"][0]["args"]["scorer"] == "magnitude"
    assert data["eval"] == {"zeroshot": None}
    with pytest.raises(SlimkitError, match="not an index"):
        apply_override(data, "stages.4.args.scorer=x")


def test_an_override_one_past_the_end_of_a_list_appends():
    data = {"stages": [{"stage": "search"}]}
    apply_override(data, "stages.1={stage: distill, args: {steps: 50}}")
    assert data["stages"] == [{"stage": "search"}, {"stage": "distill", "args": {"steps": 50}}]
    with pytest.raises(SlimkitError, match=r"'3' is not an index of a list of 2 \(index 2 appends\)"):
        apply_override(data, "stages.3={stage: lora}")
    with pytest.raises(SlimkitError, match=r"'2' is not an index of a list of 2$"):
        apply_override(data, "stages.2.args.steps=1")  # only the last part of the path may append
    recipe, _ = load_recipe("search", ["stages.1={stage: distill, args: {steps: 50}}"])
    assert [stage.stage for stage in recipe.stages] == ["search", "distill"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target": {"ratio": 1.0}}, "target.ratio: Input should be less than 1"),
        ({"target": {"ratio": -0.1}}, "target.ratio: Input should be greater than or equal to 0"),
        ({"target": {"ratio": 0.2, "of": "heads"}}, "target.of: Input should be 'model', 'layers', 'mlp' or"),
        ({"stages": [{"stage": "shrink_everything"}]}, "stages.0: unknown stage 'shrink_everything'; allowed: "),
        (
            {"stages": [{"stage": "prune", "args": {"scorer": "taylor9"}}]},
            "stages.0: args.scorer: unknown scorer 'taylor9'; did you mean 'taylor'? allowed: activation, coupled,",
        ),
        (
            {"stages": [{"stage": "prune", "args": {"aggregate": "l2"}}]},
            "args: unknown field 'aggregate'; did you mean 'aggregation'? allowed: scorer, aggregation, order",
        ),
        ({"calibration": {"dataset": "wiki103"}}, "calibration.dataset: unknown dataset 'wiki103'; allowed:"),
        ({"eval": {"zeroshot": {"tasks": ["mmlu"]}}}, "eval.zeroshot.tasks: unknown zero-shot task 'mmlu'"),
        ({"stagez": []}, "unknown field 'stagez'; did you mean 'stages'? allowed: name, description"),
    ],
)
def test_bad_recipes_name_field_and_allowed_values(tmp_path, change, message):
    with pytest.raises(SlimkitError) as error:
        validate(tiny_recipe(tmp_path, **change), "r.yaml")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("stage", "args", "message"),
    [
        ("prune_layer", {"scorer": "taylor"}, "taylor needs whole-model gradients"),
        ("prune_layer", {"groups": ["hidden_feature"]}, "hidden_feature spans every layer"),
        ("prune", {"groups": ["attention_head", "kv_group"]}, "choose attention_head or kv_group"),
        ("prune", {"groups": ["heads"]}, "Input should be 'mlp_channel', 'attention_head'"),
    ],
)
def test_stage_argument_rules(tmp_path, stage, args, message):
    with pytest.raises(SlimkitError, match=message):
        validate(tiny_recipe(tmp_path, stages=[{"stage": stage, "args": args}]), "r.yaml")


def test_end_to_end_tiny_run(tmp_path, tiny_llama_dir):
    recipe = validate(tiny_recipe(tiny_llama_dir), "tiny")
    out = tmp_path / "run"
    report = slimkit.run(recipe, out).report.as_json()
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    for key in ("recipe", "model", "seed", "timings_s", "peak_rss_mb", "metrics", "versions", "macs"):
        assert key in saved
    assert saved["target"] == {
        "ratio": 0.25,
        "of": "mlp",
        "achieved": pytest.approx(0.25),
        "tolerance": 0.005,
        "strict": True,
        "met": True,
        "shares": {"0:sequential[prune_layer]": pytest.approx(0.25)},
    }
    assert saved["params"]["after"] < saved["params"]["before"]
    assert saved["macs"]["after"] < saved["macs"]["before"]
    assert 0 < saved["params"]["removed_ratio"] < 0.25
    assert set(saved["timings_s"]["stages"]) >= {"load", "calibration", "0:sequential[prune_layer]", "save"}
    assert saved["metrics"]["wikitext2_ppl"] > 1
    assert (out / "report.md").read_text().startswith("# slimkit report: tiny-wanda")
    assert (out / "widths.png").stat().st_size > 1000
    model, _tok = slimkit.load(out / "model")
    assert ModelView(model).layer(0).mlp_width == 48
    plain = AutoModelForCausalLM.from_pretrained(out / "model")
    ids = torch.randint(3, 200, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits)
    assert yaml.safe_load((out / "model" / "recipe.yaml").read_text())["name"] == "tiny-wanda"
    manifest = json.loads((out / "model" / "slimkit_manifest.json").read_text())
    assert manifest["calibration"]["tokens"] == 128 and manifest["seed"] == 0


@pytest.mark.slow
def test_calibrating_on_the_evaluation_set_is_noted(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(tiny_llama_dir, calibration={"dataset": "wikitext2", "samples": 2, "seq_len": 16})
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    assert any("both use wikitext2" in note for note in report["notes"])


def test_top_level_layer_stage_uses_dense_statistics(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(tiny_llama_dir, stages=[{"stage": "prune_layer", "args": {"scorer": "magnitude"}}])
    raw["eval"] = {"perplexity": None}
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    assert report["calibration"] is None and report["metrics"] == {}
    assert all(w["intermediate_size"] == 48 for w in report["layers"]["after"])


@pytest.mark.slow
def test_zero_shot_evaluation_through_the_runner(tmp_path, tiny_llama_dir):
    raw = tiny_recipe(tiny_llama_dir)
    raw["eval"] = {"perplexity": None, "zeroshot": {"tasks": ["piqa", "boolq"], "limit": 2, "batch_size": 2}}
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    metrics = report["metrics"]
    assert {"piqa_acc", "piqa_acc_norm", "boolq_acc", "zeroshot_mean_acc"} <= set(metrics)
    assert metrics["zeroshot_mean_acc"] == pytest.approx((metrics["piqa_acc"] + metrics["boolq_acc"]) / 2)
    assert report["evaluation"]["zeroshot"]["results"]["piqa"]["n"] == 2


def test_the_schema_docstring_example_validates():
    import slimkit.recipes.schema as schema

    example = yaml.safe_load(schema.__doc__.split("```yaml")[1].split("```")[0])
    recipe = validate(example, "schema docstring")
    assert [s.stage for s in recipe.flat_stages()] == ["lowrank", "prune"]


def test_reading_a_recipe_never_blocks_on_a_named_pipe(tmp_path):
    """A named pipe where the recipe file was (swapped in after recipe_path's check) is one line, not a read that
    waits for a writer forever: the file is opened without blocking and checked on its descriptor."""
    import os

    from slimkit.recipes.loading import read_recipe_text

    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SlimkitError, match=r"is not a regular file; give a \.yaml file"):
        read_recipe_text(fifo)
    plain = tmp_path / "p.yaml"
    plain.write_bytes(b"recipe: x\r\n")
    assert read_recipe_text(plain) == "recipe: x\r\n"
