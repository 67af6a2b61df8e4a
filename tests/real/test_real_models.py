"""The marked tier on the real shipped models (run with the rest by `make test`; `-m "not real"` skips it).

Checks the facts the issue states about each source, the GGUF -> safetensors cache, and one real
end-to-end recipe run whose saved model reloads to the perplexity the report states.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.evaluate.counting import count_params
from slimkit.primitives.evaluate.perplexity import perplexity
from slimkit.primitives.io.model_sources import resolve_source
from slimkit.recipes.loading import load_recipe

pytestmark = pytest.mark.real

# A small perplexity budget for the end-to-end runs: 4 windows of 256 tokens of WikiText-2.
SMALL_EVAL = ["eval.perplexity.datasets=[wikitext2]", "eval.perplexity.max_tokens=1024", "eval.perplexity.seq_len=256"]


def assert_reloaded_perplexity(model, tokenizer, report) -> None:
    """The saved model, reloaded, reproduces the perplexity the run reported."""
    again = perplexity(model, tokenizer, "wikitext2", seq_len=256, max_tokens=1024)
    assert again.perplexity == pytest.approx(report["metrics"]["wikitext2_ppl"], rel=1e-4)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    # One conversion of the GGUF for the whole module (about 25 s), shared by its tests.
    return tmp_path_factory.mktemp("real-cache")


@pytest.fixture
def smollm2(real_cache, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    return slimkit.load_source("smollm2-135m")


def test_smollm2_source_facts(smollm2, real_cache):
    model, tokenizer, _info = smollm2
    view = ModelView(model)
    assert view.spec.model_type == "llama" and view.num_layers == 30 and view.hidden_size == 576
    layer = view.layer(0)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.mlp_width) == (9, 3, 64, 1536)
    assert layer.attn_norm.kind == "rmsnorm" and view.tied
    assert count_params(model) == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    folder, _ = resolve_source("smollm2-135m")
    assert folder.is_relative_to(real_cache) and (folder / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_minilm_source_facts():
    model, tokenizer, _info = slimkit.load_source("minilm-l6")
    view = ModelView(model)
    assert view.spec.model_type == "bert" and view.num_layers == 6 and view.hidden_size == 384
    assert view.layer(0).num_heads == 12 and view.layer(0).attn_norm.placement == "post"
    assert round(count_params(model) / 1e6, 1) == 22.7
    batch = tokenizer(["a cat sat on the mat", "stocks fell sharply"], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape[-1] == 384 and torch.isfinite(hidden).all()


def test_wanda_channels_end_to_end_on_smollm2(real_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    overrides = [
        "calibration.samples=8",
        "eval.perplexity.max_tokens=2048",
        "eval.perplexity.seq_len=256",
        "target.of=mlp",
        "stages.0.sequential.0.args.groups=[mlp_channel]",
    ]
    recipe, _raw = load_recipe("wanda-channels", overrides)
    report = slimkit.run(recipe, tmp_path / "run").report.as_json()
    assert report["target"]["achieved"] == pytest.approx(0.2, abs=1e-3)
    assert report["params"]["before"] == 134_515_008
    assert report["params"]["after"] == 134_515_008 - 30 * 3 * 576 * (1536 - 1229)
    ppl = report["metrics"]["wikitext2_ppl"]
    assert math.isfinite(ppl)
    model, tokenizer = slimkit.load(tmp_path / "run" / "model")
    again = perplexity(model, tokenizer, "wikitext2", seq_len=256, max_tokens=2048)
    assert again.perplexity == pytest.approx(ppl, rel=1e-4)


def test_llm_pruner_meets_the_target_and_reloads(real_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    overrides = [
        "target.ratio=0.2",
        "calibration.samples=4",
        "stages.1.args.steps=1",
        "stages.1.args.batch_size=1",
        *SMALL_EVAL,
    ]
    recipe, _raw = load_recipe("llm-pruner", overrides)
    report = slimkit.run(recipe, tmp_path / "run").report.as_json()
    assert abs(report["target"]["achieved"] - 0.2) < 0.01
    widths = report["layers"]["after"]
    assert (
        widths[0]
        == widths[-1]
        == {
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "intermediate_size": 1536,
        }
    )
    assert all(w["num_attention_heads"] % 3 == 0 and w["num_key_value_heads"] == 3 for w in widths)
    assert report["stages"]["lora"]["steps"] == 1
    model, tokenizer = slimkit.load(tmp_path / "run" / "model")
    assert_reloaded_perplexity(model, tokenizer, report)


def test_lorap_low_rank_pairs_survive_save_and_load(real_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    overrides = [
        "calibration.samples=4",
        "calibration.batch_size=4",
        "stages.1.args.steps=0",
        *SMALL_EVAL,
    ]
    recipe, _raw = load_recipe("lorap", overrides)
    report = slimkit.run(recipe, tmp_path / "run").report.as_json()
    assert abs(report["target"]["achieved"] - 0.2) < 0.01
    assert report["stages"]["lowrank"]["ranks"]["0"] == {"q": 142, "k": 71, "v": None, "o": None}
    model, tokenizer = slimkit.load(tmp_path / "run" / "model")
    assert type(ModelView(model).layer(5).linear("q")).__name__ == "LowRankLinear"
    assert_reloaded_perplexity(model, tokenizer, report)


def test_prunenet_is_calibration_free_and_reuses_its_policy(real_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    evals = SMALL_EVAL
    recipe, _raw = load_recipe("prunenet", ["stages.0.args.episodes=2", *evals])
    report = slimkit.run(recipe, tmp_path / "r20").report.as_json()
    assert report["calibration"] is None and report["target"]["achieved"] == pytest.approx(0.2, abs=1e-3)
    assert len(report["stages"]["prunenet"]["policy"]["episode_penalty"]) == 2
    policy = tmp_path / "r20" / "policy"
    recipe, _raw = load_recipe("prunenet", ["target.ratio=0.3", f"stages.0.args.policy={policy}", *evals])
    second = slimkit.run(recipe, tmp_path / "r30").report.as_json()
    assert second["stages"]["prunenet"]["policy"] == {"loaded_from": str(policy)}
    model, _tokenizer = slimkit.load(tmp_path / "r30" / "model")
    assert {layer.mlp_width for layer in ModelView(model).layers} == {1075}
