"""save/load round trips: non-uniform widths reload with identical logits; uniform loads in plain HF."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.surgery import prune_layer
from tests.tiny import model_output


def _prune_non_uniform(model):
    view = ModelView(model)
    for layer in view.layers:
        width = layer.mlp_width - 4 * (layer.index + 1)
        prune_layer(model, "mlp_channel", layer.index, torch.randperm(layer.mlp_width)[:width])
    prune_layer(model, "kv_group", 0, torch.tensor([view.layer(0).num_kv_heads - 1]))


@pytest.mark.parametrize("family", ["llama", "opt", "bert"])
def test_non_uniform_round_trip_identical_logits(family, request, tmp_path, tokenizer):
    model = request.getfixturevalue(family)
    _prune_non_uniform(model)
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(model, ids)
    path = slimkit.save(model, tokenizer, tmp_path / "m", manifest={"recipe": "test", "seed": 0})
    config = json.loads((path / "config.json").read_text())
    assert set(config["per_layer_config"]) == {str(i) for i in range(ModelView(model).num_layers)}
    loaded, tok = slimkit.load(path, task="encoder" if family == "bert" else "causal-lm")
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
    assert tok is not None and tok("ab").input_ids == tokenizer("ab").input_ids
    manifest = slimkit.primitives.io.read_manifest(path)
    assert manifest["recipe"] == "test" and manifest["versions"]["torch"].startswith("2.")
    assert not list(path.glob("*.bin")) and not list(path.glob("*.pt"))


def test_uniform_result_loads_with_plain_from_pretrained(llama, tmp_path, tokenizer):
    view = ModelView(llama)
    for layer in view.layers:
        prune_layer(llama, "mlp_channel", layer.index, torch.arange(40))
        prune_layer(llama, "kv_group", layer.index, torch.tensor([1]))
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(llama, ids)
    path = slimkit.save(llama, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert "per_layer_config" not in config
    assert (config["intermediate_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (40, 3, 1)
    plain = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(model_output(plain, ids), before, rtol=0, atol=0)


def test_uniform_bert_loads_with_plain_auto_model(bert, tmp_path):
    for layer in ModelView(bert).layers:
        prune_layer(bert, "mlp_channel", layer.index, torch.arange(30))
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(bert, ids)
    path = slimkit.save(bert, None, tmp_path / "m")
    torch.testing.assert_close(model_output(AutoModel.from_pretrained(path), ids), before, rtol=0, atol=0)


def test_save_refuses_non_empty_directory_and_leaves_no_partial(llama, tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        slimkit.save(llama, None, target)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_interrupted_save_leaves_nothing_that_loads(llama, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("slimkit.primitives.io.save"), "_write_json", boom)
    with pytest.raises(KeyboardInterrupt):
        slimkit.save(llama, None, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
