"""A model slimkit compressed earlier, compressed or recovered again: the dense comparison, a distill teacher and a
top-level reconstruct use the dense model it came from (``primitives.sources.dense_origin``), not the input itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.model_sources import dense_origin
from slimkit.recipes.loading import validate
from tests.tiny import tiny_llama

PPL = {"perplexity": {"datasets": ["wikitext2"], "seq_len": 32, "max_tokens": 64}}
CALIBRATION = {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2}


@pytest.fixture
def sharp_llama_dir(tmp_path, tokenizer) -> Path:
    """A tiny llama with peaked next-token distributions (weights x 5), so pruning moves its logits measurably."""
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(5.0)
    folder = tmp_path / "sharp-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _prune(model: Path | str, ratio: float = 0.5, evaluate: dict | None = None) -> dict:
    return {
        "name": "prune",
        "model": str(model),
        "seed": 0,
        "calibration": CALIBRATION,
        "target": {"ratio": ratio, "of": "mlp", "tolerance": 0.05},
        "stages": [{"sequential": [{"stage": "prune_layer", "args": {"groups": ["mlp_channel"]}}]}],
        "eval": evaluate or {"perplexity": None},
    }


def _distill(model: Path | str, steps: int, evaluate: dict | None = None, **args) -> dict:
    stage = {"steps": steps, "batch_size": 2, "seq_len": 32, "dataset": "alpaca", "rank": 2, "alpha": 4, **args}
    return {
        "name": "recover",
        "model": str(model),
        "seed": 0,
        "target": {"ratio": 0.0},
        "stages": [{"stage": "distill", "args": stage}],
        "eval": evaluate or {"perplexity": None},
    }


def test_dense_origin_follows_manifests_to_the_first_model_slimkit_did_not_write(sharp_llama_dir, tmp_path):
    assert dense_origin(None) is None and dense_origin(sharp_llama_dir) is None  # not slimkit outputs
    slimkit.run(validate(_prune(sharp_llama_dir, 0.25), "a"), out=tmp_path / "a", evaluate=False)
    slimkit.run(validate(_prune(tmp_path / "a" / "model", 0.25), "b"), out=tmp_path / "b", evaluate=False)
    origin = dense_origin(tmp_path / "b" / "model")
    assert origin["path"] == str(sharp_llama_dir.resolve()) and origin["name"] == str(sharp_llama_dir)
    assert origin["via"] == [str((tmp_path / d / "model").resolve()) for d in ("b", "a")]
    assert origin["stages"] == ["prune_layer", "prune_layer"] and "missing" not in origin
    # the dense folder gone: the origin is named, its path None, and why
    shutil.move(sharp_llama_dir, tmp_path / "elsewhere")
    gone = dense_origin(tmp_path / "b" / "model")
    assert gone["path"] is None and gone["name"] == str(sharp_llama_dir) and "not found here" in gone["missing"]


def test_distilling_a_saved_compressed_model_uses_the_dense_teacher(sharp_llama_dir, tmp_path):
    compressed = slimkit.run(validate(_prune(sharp_llama_dir), "p"), out=tmp_path / "p", evaluate=False)
    result = slimkit.run(validate(_distill(tmp_path / "p" / "model", 1), "d"), evaluate=False)
    report = result.report.as_json()
    distill = report["stages"]["distill"]
    # The teacher is the dense model: its KL to the pruned student is positive before any update (a teacher
    # reloaded from the input folder would be the student itself, KL 0).
    assert distill["teacher_source"] == str(sharp_llama_dir) and distill["kl_first"] > 1e-4
    assert any(n.startswith("the model is a slimkit output compressed from") for n in report["notes"])
    assert report["params"]["before"] == sum(p.numel() for p in compressed.model.parameters())


def test_the_dense_comparison_of_a_saved_compressed_model_is_the_dense_model(sharp_llama_dir, tmp_path):
    first = slimkit.run(validate(_prune(sharp_llama_dir, evaluate=PPL), "p"), out=tmp_path / "p")
    again = slimkit.run(validate(_distill(tmp_path / "p" / "model", 0, evaluate=PPL), "d"))
    dense, compressed = first.report.dense.metrics, first.report.metrics
    assert again.report.dense.metrics == dense and again.report.dense.metrics != compressed
    assert again.report.metrics["wikitext2_ppl"] == pytest.approx(compressed["wikitext2_ppl"])


def test_a_dense_origin_that_is_gone_is_refused_before_any_compute(sharp_llama_dir, tmp_path):
    slimkit.run(validate(_prune(sharp_llama_dir), "p"), out=tmp_path / "p", evaluate=False)
    shutil.move(sharp_llama_dir, tmp_path / "elsewhere")
    with pytest.raises(SlimkitError, match=r"^stages\.0 \(distill\): reloads the dense model, but .* not found here"):
        slimkit.run(validate(_distill(tmp_path / "p" / "model", 1), "d"), out=tmp_path / "d", evaluate=False)
    assert not (tmp_path / "d").exists()
    # without a stage that reloads it, the run goes on and says there is no dense comparison
    report = slimkit.run(validate(_distill(tmp_path / "p" / "model", 0, evaluate=PPL), "d")).report.as_json()
    assert any(n.startswith("no dense comparison:") and "not found here" in n for n in report["notes"])


def test_a_hidden_state_term_against_a_projected_input_is_refused(sharp_llama_dir, tmp_path):
    saved = slimkit.run(validate(_prune(sharp_llama_dir), "p"), out=tmp_path / "p", evaluate=False)
    manifest = tmp_path / "p" / "model" / "slimkit_manifest.json"
    # as if the input had been made by SP3's PCA projection (a recipe with a pca_project stage)
    text = manifest.read_text().replace('"stage": "prune_layer"', '"stage": "pca_project"')
    manifest.write_text(text)
    assert saved is not None and dense_origin(tmp_path / "p" / "model")["stages"] == ["pca_project"]
    with pytest.raises(SlimkitError, match=r"^distill: hidden_weight > 0 .* pca_project stage") as error:
        slimkit.run(validate(_distill(tmp_path / "p" / "model", 1, hidden_weight=0.5), "d"), evaluate=False)
    assert "\n" not in str(error.value)


def test_a_saved_low_rank_model_is_distilled_from_its_folder(sharp_llama_dir, tmp_path):
    # A folder with low-rank pairs has a marked config.json (stock AutoConfig refuses it): the memory plan reads its
    # config through slimkit (it raised transformers' unknown-model-type error before the run started).
    lowrank = {"stage": "lowrank", "args": {"mac_fraction": 1.0, "ratio": 0.5, "roles": ["q", "k", "v", "o"]}}
    raw = {**_prune(sharp_llama_dir), "target": {"ratio": 0.5, "of": "attention", "tolerance": 0.05}}
    raw["stages"] = [{"sequential": [lowrank]}]
    slimkit.run(validate(raw, "l"), out=tmp_path / "l", evaluate=False)
    config = (tmp_path / "l" / "model" / "config.json").read_text()
    assert '"slimkit_compressed"' in config
    report = slimkit.run(validate(_distill(tmp_path / "l" / "model", 1), "d"), evaluate=False).report.as_json()
    assert report["stages"]["distill"]["teacher_source"] == str(sharp_llama_dir)
    assert report["stages"]["distill"]["kl_first"] > 1e-4


def test_an_origin_that_is_no_model_folder_is_named_not_followed(sharp_llama_dir, tmp_path):
    slimkit.run(validate(_prune(sharp_llama_dir), "p"), out=tmp_path / "p", evaluate=False)
    (sharp_llama_dir / "config.json").unlink()  # the dense folder is still there, but no model folder any more
    origin = dense_origin(tmp_path / "p" / "model")
    assert origin["path"] is None and "config.json" in origin["missing"]


def test_a_hidden_state_term_after_a_projection_in_the_same_recipe_is_refused_before_any_compute(
    sharp_llama_dir, tmp_path
):
    raw = _distill(sharp_llama_dir, 1, hidden_weight=0.5)
    raw["calibration"] = CALIBRATION
    raw["stages"] = [{"stage": "pca_project", "args": {"group_size": "all"}}, *raw["stages"]]
    with pytest.raises(SlimkitError, match=r"^distill: hidden_weight > 0 .* pca_project stage changes") as error:
        slimkit.run(validate(raw, "d"), out=tmp_path / "d", evaluate=False)
    assert "\n" not in str(error.value) and not (tmp_path / "d").exists()
