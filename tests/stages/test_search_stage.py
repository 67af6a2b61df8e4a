"""The ``search`` stage on the tiny llama of ``tiny_llama_dir`` (3 layers; 6 query heads over 2 KV groups, 64 MLP
channels): it lands on the target, its written recipe reproduces the searched model bit for bit without searching, a
second search reads its library, and a latency or memory budget is honoured."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import validate
from tests.recipes.test_recipes import tiny_recipe

SMALL = {
    "heads": [0.67],
    "kv_groups": [],
    "attention_lowrank": [0.5],
    "channels": [0.75, 0.5],
    "experts": [],
}
CALIBRATION = {"dataset": "c4", "samples": 6, "seq_len": 32, "batch_size": 2}


def _recipe(model_dir, ratio: float = 0.15, **args) -> dict:
    stage = {"stage": "search", "args": {"candidates": SMALL, **args}}
    return tiny_recipe(model_dir, target={"ratio": ratio, "of": "model"}, stages=[stage], calibration=CALIBRATION)


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_the_written_recipe_reproduces_the_searched_model_bit_for_bit(tmp_path, tiny_llama_dir):
    result = slimkit.run(_recipe(tiny_llama_dir), tmp_path / "run", evaluate=False)
    assert result.report.target.met
    entry = result.report.as_json()["stages"]["search"]
    assert entry["mode"] == "searched" and entry["solver"]["optimal"]
    assert set(entry["layers"]) == {"0", "1", "2"}
    assert entry["kl_measured"] > 0 and entry["kl_sum"] > 0
    folder = tmp_path / "run" / "search"
    assert {p.name for p in folder.iterdir()} >= {"recipe.yaml", "scores.json", "scores.png", "layers.md"}
    written = yaml.safe_load((folder / "recipe.yaml").read_text())
    chosen = written["stages"][0]["args"]["chosen"]
    assert {layer: parts for layer, parts in chosen.items()} == {
        int(layer): {p: row[p] for p in ("attention", "mlp")} for layer, row in entry["layers"].items()
    }
    written["stages"][0]["args"]["store"] = False  # built again from the weights and the calibration, not read
    again = slimkit.run(written, evaluate=False)
    assert again.report.as_json()["stages"]["search"]["mode"] == "fixed"
    expected, got = _state(result.model), _state(again.model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.model(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_a_second_search_at_another_target_builds_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))  # an empty store
    first = slimkit.run(_recipe(tiny_llama_dir, 0.15), evaluate=False).report.as_json()["stages"]["search"]
    second = slimkit.run(_recipe(tiny_llama_dir, 0.3), evaluate=False)
    cost = second.report.as_json()["stages"]["search"]["cost"]
    assert first["cost"]["built"] == first["candidates"] and first["cost"]["read"] == 0
    assert cost["built"] == 0 and cost["read"] == first["candidates"] and cost["scores_measured"] == 0
    assert second.report.target.met


def _table(scores_json, slow: str) -> dict:
    """A latency table for every candidate of the run: each removes time in proportion to its parameters, except the
    kind ``slow``, which adds time."""
    entries = json.loads(scores_json.read_text())
    added = {}
    for e in entries:
        if e["candidate"] == "dense":
            continue
        seconds = -e["removed"]["total"] * 1e-6
        if e["candidate"].startswith(slow):
            seconds = 0.01
        added[f"{e['part']}/{e['candidate']}"] = {"prefill": seconds, "decode": seconds / 10}
    return {"runtime": "llama.cpp", "dense": {"prefill": 0.06, "decode": 0.006}, "added": added}


@pytest.mark.slow
def test_a_latency_budget_is_honoured_against_the_given_table(tmp_path, tiny_llama_dir):
    plain = slimkit.run(_recipe(tiny_llama_dir, 0.0, time_limit=600), tmp_path / "plain", evaluate=False)
    assert plain.report.target.met
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(tmp_path / "plain" / "search" / "scores.json", "lowrank")))
    budget = {"speedup": 1.25, "runtime": "llama.cpp", "table": str(path)}
    recipe = _recipe(tiny_llama_dir, 0.0, latency_budget=budget)
    recipe["target"]["tolerance"] = 1.0  # no parameter budget: the latency binds
    result = slimkit.run(recipe, evaluate=False)
    entry = result.report.as_json()["stages"]["search"]
    phases = entry["latency"]["phases"]
    assert phases["prefill"]["speedup"] >= 1.25 and phases["decode"]["speedup"] >= 1.25
    table = json.loads(path.read_text())
    for phase in ("prefill", "decode"):
        added = sum(
            table["added"][f"{part}/{row[part]}"][phase]
            for row in entry["layers"].values()
            for part in ("attention", "mlp")
            if row[part] != "dense"
        )
        assert table["dense"][phase] + added <= table["dense"][phase] / 1.25 + 1e-12
    assert all(row["attention"] != "lowrank:0.5" for row in entry["layers"].values())  # it adds time here
    budget["speedup"] = 50.0
    with pytest.raises(SlimkitError, match=r"no choice of candidates meets budget llama\.cpp prefill seconds added"):
        slimkit.run(_recipe(tiny_llama_dir, 0.0, latency_budget=budget) | {"target": recipe["target"]}, evaluate=False)


@pytest.mark.slow
def test_a_memory_budget_is_honoured(tiny_llama_dir):
    budget = {"limit": "200KB", "context": 256, "batch": 2}
    recipe = _recipe(tiny_llama_dir, 0.0, memory_budget=budget)
    recipe["target"]["tolerance"] = 1.0
    result = slimkit.run(recipe, evaluate=False)
    entry = result.report.as_json()["stages"]["search"]
    from slimkit.primitives.search.costs import MemoryAt, model_memory

    assert model_memory(result.model, MemoryAt(256, 2, 2)) <= 200_000
    assert entry["memory"]["dense_bytes"] > 200_000


@pytest.mark.slow
def test_uniform_sub_blocks_take_one_replacement_in_every_layer(tmp_path, tiny_llama_dir):
    recipe = _recipe(tiny_llama_dir, 0.15, uniform=["attention", "mlp"])
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    assert result.report.target.met  # the levels solved from the target put a uniform pair in its window
    entry = result.report.as_json()["stages"]["search"]
    assert entry["uniform"]["parts"] == ["attention", "mlp"] and entry["uniform"]["equalities"] > 0
    assert not any(name.startswith("same choice") for name in entry["budgets"])
    for part in ("attention", "mlp"):
        assert len({row[part] for row in entry["layers"].values()}) == 1, entry["layers"]
    (removed,) = [budget for name, budget in entry["budgets"].items() if name.startswith("parameters removed")]
    assert removed["total"] > 0
    written = yaml.safe_load((tmp_path / "run" / "search" / "recipe.yaml").read_text())
    assert "uniform" not in written["stages"][0]["args"]  # a fixed choice reads no constraint


@pytest.mark.slow
def test_without_the_solved_levels_one_uniform_pair_misses_the_target(tiny_llama_dir):
    recipe = _recipe(tiny_llama_dir, 0.15, uniform=["attention", "mlp"], candidates={**SMALL, "target_levels": False})
    with pytest.raises(SlimkitError, match="the nearest: "):
        slimkit.run(recipe, evaluate=False)


def test_bad_arguments_are_refused_at_validation(tiny_llama_dir):
    with pytest.raises(SlimkitError, match=r"args\.uniform: each sub-block once"):
        validate(_recipe(tiny_llama_dir, uniform=["mlp", "mlp"]), "recipe")
    with pytest.raises(SlimkitError, match=r"uniform\.0: Input should be 'attention' or 'mlp'"):
        validate(_recipe(tiny_llama_dir, uniform=["ffn"]), "recipe")
    with pytest.raises(SlimkitError, match="layer 0: mlp candidate 'channels:x'"):
        validate(_recipe(tiny_llama_dir, chosen={0: {"mlp": "channels:x"}}), "recipe")
    with pytest.raises(SlimkitError, match="holdout 3 leaves no calibration batch"):
        validate(_recipe(tiny_llama_dir, holdout=3), "recipe")
    with pytest.raises(SlimkitError, match=r"memory_budget\.limit"):
        validate(_recipe(tiny_llama_dir, memory_budget={"limit": "lots"}), "recipe")
    with pytest.raises(SlimkitError, match="speedup"):
        validate(_recipe(tiny_llama_dir, latency_budget={"speedup": 0.5}), "recipe")


def test_a_chosen_layer_the_model_lacks_is_refused_before_calibration(tiny_llama_dir):
    with pytest.raises(SlimkitError, match="chosen names layer 7; the model has layers 0-2"):
        slimkit.run(_recipe(tiny_llama_dir, chosen={7: {"mlp": "removed"}}), evaluate=False)


@pytest.mark.slow
def test_a_strict_target_between_the_candidates_sizes_is_refused_naming_the_nearest(tiny_llama_dir):
    recipe = _recipe(tiny_llama_dir, 0.101)
    recipe["target"]["tolerance"] = 0.0001
    with pytest.raises(SlimkitError, match=r"removes [\d,]+-[\d,]+ parameters within the other budgets; the nearest: "):
        slimkit.run(recipe, evaluate=False)
    recipe["target"]["strict"] = False
    result = slimkit.run(recipe, evaluate=False)
    assert not result.report.target.met
    assert any("the target is not strict, so the search lands there" in note for note in result.report.notes)
