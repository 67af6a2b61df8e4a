"""The Python API mirrors the CLI: Recipe.from_yaml / Recipe(**mapping), slimkit.run, slimkit.evaluate; and the
one-budget rule on Target and Context."""

from __future__ import annotations

import json
import math

import pytest
import torch

import slimkit
from slimkit.engine.context import Context
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.lowrank import layer_ratio
from slimkit.recipes.schema import Target
from slimkit.stages.layer_rule import layer_rule_ratio
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import tiny_llama


def test_recipe_from_yaml_and_from_a_mapping_keep_their_source(tiny_llama_dir):
    recipe = slimkit.Recipe.from_yaml("wanda-channels", overrides=["target.ratio=0.3"])
    assert recipe.target.ratio == 0.3 and recipe.source()["target"]["ratio"] == 0.3
    raw = tiny_recipe(tiny_llama_dir)
    built = slimkit.Recipe(**raw)
    assert built.source() == raw and built.source() is not built.source()
    with pytest.raises(SlimkitError, match=r"unknown recipe 'wanda-chanels'; did you mean 'wanda-channels'"):
        slimkit.Recipe.from_yaml("wanda-chanels")


def test_run_in_memory_writes_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = slimkit.run(tiny_recipe(tiny_llama_dir), evaluate=False)
    assert (
        result.out is None
        and list(work.iterdir()) == []
        and sorted(tmp_path.iterdir()) == sorted([work, tiny_llama_dir])
    )
    assert result.report.target.met and result.report.metrics == {}
    assert params_by_part(result.model)["mlp"] == pytest.approx(0.75 * result.report.params.by_part_before["mlp"])
    overridden = slimkit.run(
        slimkit.Recipe(**tiny_recipe(tiny_llama_dir)), overrides=["target.ratio=0.5"], evaluate=False
    )
    assert overridden.report.target.achieved == pytest.approx(0.5)


def test_run_compresses_a_model_in_memory_and_saves_it(tmp_path, tiny_llama_dir, tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    result = slimkit.run(tiny_recipe(tiny_llama_dir), out=tmp_path / "run", model=model, tokenizer=tokenizer)
    assert result.model is model and result.report.model == "in-memory model"
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    batch = torch.randint(3, 250, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model(batch).logits)
    assert math.isfinite(result.report.metrics["wikitext2_ppl"])
    assert (
        result.report.dense is None and "no dense comparison: an in-memory model has no source" in result.report.notes
    )


@pytest.mark.slow
def test_the_report_compares_with_the_dense_model_measured_once(tmp_path, tiny_llama_dir, monkeypatch):
    """The dense model's metrics (same settings) sit beside the run's; the second run reads them from the cache and
    compresses exactly as the first; ``compare_dense=False`` leaves them out."""
    # its own cache: entries are keyed by the weights' content, which other tests' tiny models may share
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    first = slimkit.run(tiny_recipe(tiny_llama_dir), out=tmp_path / "first")
    dense = first.report.dense
    assert dense is not None and not dense.cached and set(dense.metrics) == {"wikitext2_ppl"}
    model, tokenizer, _info = slimkit.load_source(str(tiny_llama_dir))
    direct = slimkit.evaluate(model, tokenizer, perplexity=["wikitext2"], seq_len=32, max_tokens=128)
    assert dense.metrics["wikitext2_ppl"] == pytest.approx(direct["wikitext2_ppl"], rel=1e-6)
    second = slimkit.run(tiny_recipe(tiny_llama_dir), out=tmp_path / "second")
    assert second.report.dense == dense.model_copy(update={"cached": True})
    assert second.report.metrics == first.report.metrics and second.report.params == first.report.params
    ppl, base = first.report.metrics["wikitext2_ppl"], dense.metrics["wikitext2_ppl"]
    last = (tmp_path / "first" / "report.md").read_text().splitlines()[-1]
    assert last == f"WikiText-2 {ppl:.4g} vs dense {base:.4g} ({ppl / base:.2f}x)"
    assert json.loads((tmp_path / "first" / "report.json").read_text())["dense"]["metrics"] == dense.metrics
    off = slimkit.run(tiny_recipe(tiny_llama_dir), compare_dense=False)
    assert off.report.dense is None and off.report.metrics == first.report.metrics


def test_evaluate_matches_the_cli_metric_names(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    metrics = slimkit.evaluate(model, tokenizer, perplexity=["wikitext2", "ptb"], seq_len=32, max_tokens=64)
    assert set(metrics) == {"wikitext2_ppl", "ptb_ppl"} and all(math.isfinite(v) for v in metrics.values())
    with pytest.raises(SlimkitError, match=r"evaluate: perplexity\.datasets: unknown dataset 'wiki'"):
        slimkit.evaluate(model, tokenizer, perplexity=["wiki"])


def test_target_rule_by_hand():
    target = Target(ratio=0.2, of="mlp", tolerance=0.01)
    dense, now = {"total": 1000, "mlp": 600}, {"total": 870, "mlp": 485}
    assert target.part == "mlp" and target.kept_limit(dense) == 480
    assert target.achieved(dense, now) == pytest.approx(115 / 600)
    assert target.met(0.19) and target.met(0.21) and not target.met(0.211)
    with pytest.raises(ValueError):
        Target(ratio=float("nan"))


def test_context_budget_counts_what_earlier_stages_did(tokenizer, tiny_llama_dir):
    recipe = slimkit.Recipe(**tiny_recipe(tiny_llama_dir, target={"ratio": 0.2, "of": "model"}))
    model = tiny_llama(vocab_size=len(tokenizer))
    ctx = Context(recipe=recipe, model=model, tokenizer=tokenizer, source={}, generator=torch.Generator())
    ctx.params_before = dense = params_by_part(model)
    layers = ctx.view.num_layers
    per_layer = (dense["attention"] + dense["mlp"]) // layers
    ctx.start_block()
    assert ctx.budget_left() == dense["total"] - round(0.8 * dense["total"])
    # On the dense model the rule is LoRAP's Appendix C.1 formula.
    assert layer_rule_ratio(ctx) == pytest.approx(layer_ratio(dense["total"], 0.2, layers, per_layer))
    slimkit.primitives.surgery.prune_layer(model, "mlp_channel", 0, torch.arange(32))  # an earlier stage
    ctx.start_block(planned=100)
    removed = dense["total"] - params_by_part(model)["total"]
    assert ctx.budget_left() == dense["total"] - removed - round(0.8 * dense["total"])
    assert ctx.params_to_remove() == ctx.budget_left() - 100
