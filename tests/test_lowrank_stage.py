"""The `lowrank` stage and LoRAP-style recipes on a tiny model: budgets, save/load of low-rank pairs."""

from __future__ import annotations

import json

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.recipes.loading import validate
from tests.test_recipes import tiny_recipe


def lorap_recipe(model_dir, **lowrank_args):
    stages = [
        {
            "sequential": [
                {"stage": "lowrank", "args": {"mac_fraction": 1.0, **lowrank_args}},
                {
                    "stage": "prune_layer",
                    "args": {"groups": ["mlp_channel"], "protect_lowest": 0.01, "ratio_rule": "layer"},
                },
            ]
        }
    ]
    return tiny_recipe(model_dir, target={"ratio": 0.2, "of": "model", "strict": False}, stages=stages)


def test_lorap_style_run_saves_and_reloads_low_rank_pairs(tmp_path, tiny_llama_dir):
    raw = lorap_recipe(tiny_llama_dir)
    report = slimkit.run(raw, tmp_path / "run").report.as_json()
    fraction = report["stages"]["lowrank"]["fraction"]
    assert fraction == report["stages"]["prune_layer"]["unit_fraction"]
    ranks = report["stages"]["lowrank"]["ranks"]["0"]
    assert set(ranks) == {"q", "k", "v", "o"} and ranks["q"] is not None
    model, _tok = slimkit.load(tmp_path / "run" / "model")
    assert isinstance(ModelView(model).layer(0).linear("q"), LowRankLinear)
    manifest = json.loads((tmp_path / "run" / "model" / "slimkit_manifest.json").read_text())
    assert {m["kind"] for m in manifest["modules"]} == {"low_rank"}
    assert report["params"]["after"] == sum(p.numel() for p in model.parameters())
    again = slimkit.load(tmp_path / "run" / "model")[0]
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)


def test_layer_ratio_hand_case(tmp_path, tiny_llama_dir):
    # tiny llama with the 259-token byte vocabulary: embeddings 259 x 48 = 12,432, three layers of
    # attention 6,144 + mlp 9,216 + norms 96, final norm 48: total 58,848;
    # Ratio_l = 58,848 x 0.2 / (3 x 15,360) = 0.255416...
    raw = lorap_recipe(tiny_llama_dir)
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    assert report["stages"]["lowrank"]["fraction"] == pytest.approx(58_848 * 0.2 / (3 * 15_360))


def test_uniform_allocation_of_mlp_projections(tmp_path, tiny_llama_dir):
    stages = [
        {
            "sequential": [
                {
                    "stage": "lowrank",
                    "args": {
                        "roles": ["up", "down"],
                        "allocation": "uniform",
                        "method": "svd",
                        "ratio": 0.5,
                        "mac_fraction": 1.0,
                    },
                }
            ]
        }
    ]
    raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0.2, "of": "model", "strict": False}, stages=stages)
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    # up: 48 -> 64, dense 3,072, half = 1,536 -> rank floor(1,536 / 112) = 13
    assert report["stages"]["lowrank"]["ranks"]["2"] == {"up": 13, "down": 13}


def test_lorap_allocation_needs_attention_roles(tmp_path):
    bad = tiny_recipe(tmp_path, stages=[{"stage": "lowrank", "args": {"roles": ["up"]}}])
    with pytest.raises(SlimkitError, match="allocation: lorap splits the attention budget"):
        validate(bad, "r.yaml")
