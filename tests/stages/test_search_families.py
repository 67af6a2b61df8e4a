"""The ``search`` stage on the 2026 families (tiny random models): latent attention (DeepSeek-V3), q/k-normed
attention (OLMo 3), a Llama 4 MoE with its scaled routing, and the hybrids whose layers differ (Qwen 3.5's gated
DeltaNet, Nemotron-H's Mamba-2 and MLP-only layers). Each searches only what its layers hold and what its
architecture allows, and its written recipe rebuilds the searched model bit for bit."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from tests import tiny
from tests.stages.test_search_stage import _recipe, _state

FAMILIES = ["deepseek_v3", "olmo3", "llama4_text", "qwen3_5_text", "nemotron_h"]


@pytest.fixture
def family_dir(request, tmp_path, tokenizer):
    folder = tmp_path / "model"
    getattr(tiny, f"tiny_{request.param}")(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", FAMILIES, indirect=True)
def test_search_holds_to_each_layers_kind_and_its_recipe_reproduces_it(tmp_path, family_dir):
    recipe = _recipe(family_dir, 0.15)
    recipe["target"]["strict"] = False  # tiny widths: the nearest reachable count is enough here
    result = slimkit.run(recipe, tmp_path / "run", evaluate=False)
    entry = result.report.as_json()["stages"]["search"]
    assert entry["mode"] == "searched" and entry["solver"]["optimal"]
    view = ModelView(AutoModelForCausalLM.from_pretrained(family_dir))  # the dense layers
    for index, row in entry["layers"].items():
        layer = view.layer(int(index))
        assert ("attention" in row) == layer.has_attention, (index, row)
        assert ("mlp" in row) == layer.has_mlp, (index, row)
        if not {"q", "k", "v", "o"} <= set(layer.roles):  # latent attention: no low-rank of q/k/v/o
            assert not row.get("attention", "").startswith("lowrank"), row
    written = yaml.safe_load((tmp_path / "run" / "search" / "recipe.yaml").read_text())
    written["stages"][0]["args"]["store"] = False
    again = slimkit.run(written, evaluate=False)
    expected, got = _state(result.model), _state(again.model)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
