"""save/load round trips: non-uniform widths reload with identical logits; uniform loads in plain HF;
folders stock transformers cannot build exactly (low-rank pairs, residual maps, per-layer widths) are
refused by its loaders, read exactly by slimkit.load, and still give their tokenizer to AutoTokenizer."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.io.compat import SLIMKIT_MODEL_TYPE
from slimkit.primitives.lowrank import LowRankLinear
from slimkit.primitives.projection.adapters import attach_basis_change
from slimkit.primitives.surgery import prune_layer
from tests.tiny import model_output, tiny_llama


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
    assert config["model_type"] == "llama" and not [k for k in config if k.startswith("slimkit_")]
    plain = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(model_output(plain, ids), before, rtol=0, atol=0)
    loaded, _ = slimkit.load(path)
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


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


def _low_rank(model, roles=("q", "k", "v", "o"), rank=5):
    """LoRAP's attention structure: each role's Linear replaced by a rank-``rank`` pair (plain SVD)."""
    for layer in ModelView(model).layers:
        for role in roles:
            layer.set_linear(role, LowRankLinear.from_linear(layer.linear(role), rank))
    return model


def _assert_stock_loaders_refuse(path, model_class=None):
    for loader in (AutoConfig, AutoModelForCausalLM, AutoModel):
        with pytest.raises(ValueError, match=f"model type `{SLIMKIT_MODEL_TYPE}`"):
            loader.from_pretrained(path)
    if model_class is not None:  # the class called directly never refuses a config; the weight file name stops it
        with pytest.raises(OSError, match=r"model\.safetensors"):
            model_class.from_pretrained(path)


def test_low_rank_result_is_refused_by_transformers_and_read_exactly_by_slimkit(tmp_path, tokenizer):
    model = _low_rank(tiny_llama(vocab_size=len(tokenizer)))
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(model, ids)
    path = slimkit.save(model, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert "per_layer_config" not in config  # uniform widths: only the low-rank pairs need slimkit
    assert (config["model_type"], config["architectures"]) == (SLIMKIT_MODEL_TYPE, ["SlimkitCompressedModel"])
    assert (config["slimkit_base_model_type"], config["slimkit_base_architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert "12 low-rank pairs" in config["slimkit_note"] and "slimkit.load" in config["slimkit_note"]
    _assert_stock_loaders_refuse(path, LlamaForCausalLM)

    loaded, tok = slimkit.load(path)
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, LowRankLinear)
    assert loaded.config.model_type == "llama" and loaded.config.architectures == ["LlamaForCausalLM"]
    assert not hasattr(loaded.config, "slimkit_base_model_type")
    assert tok("hello").input_ids == tokenizer("hello").input_ids
    plain_tok = AutoTokenizer.from_pretrained(path)  # no model config: the export work relies on this
    assert plain_tok("hello, world").input_ids == tokenizer("hello, world").input_ids

    again = slimkit.save(loaded, tok, tmp_path / "again")  # a reloaded result is marked again
    assert json.loads((again / "config.json").read_text())["model_type"] == SLIMKIT_MODEL_TYPE
    torch.testing.assert_close(model_output(slimkit.load(again)[0], ids), before, rtol=0, atol=0)


def test_per_layer_widths_result_is_refused_by_transformers(llama, tmp_path, tokenizer):
    _prune_non_uniform(llama)
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(llama, ids)
    path = slimkit.save(llama, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == SLIMKIT_MODEL_TYPE and "per_layer_config" in config
    assert "per-layer widths" in config["slimkit_note"]
    _assert_stock_loaders_refuse(path)
    loaded, _ = slimkit.load(path)
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(path)("ab").input_ids == tokenizer("ab").input_ids


@pytest.mark.parametrize("family", ["opt", "bert"])
def test_residual_map_result_is_refused_and_round_trips(family, request, tmp_path):
    model = request.getfixturevalue(family)
    view = ModelView(model)
    d = view.hidden_size
    attach_basis_change(view.layer(1).module, torch.linalg.qr(torch.randn(d, d)).Q)
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(model, ids)
    path = slimkit.save(model, None, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == SLIMKIT_MODEL_TYPE and config["slimkit_base_model_type"] == family
    assert "1 residual / basis-change map" in config["slimkit_note"]
    with pytest.raises(ValueError, match=SLIMKIT_MODEL_TYPE):
        AutoModel.from_pretrained(path)
    loaded, _ = slimkit.load(path, task="encoder" if family == "bert" else "causal-lm")
    assert type(loaded) is type(model)
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


def test_folders_saved_before_the_mark_still_load(tmp_path, tokenizer):
    """An older slimkit wrote the model's own model_type next to manifest modules."""
    model = _low_rank(tiny_llama(vocab_size=len(tokenizer)), roles=("q", "down"), rank=3)
    ids = torch.randint(3, 200, (2, 9))
    before = model_output(model, ids)
    path = slimkit.save(model, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"], config["architectures"] = config.pop("slimkit_base_model_type"), ["LlamaForCausalLM"]
    for key in ("slimkit_base_architectures", "slimkit_note"):
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))
    loaded, tok = slimkit.load(path)
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)
    assert tok is not None
