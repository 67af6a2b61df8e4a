"""A model with removed attention / MLP blocks saves without their weights and loads back with equal outputs; the
folder's verdicts say who can read it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.blocks import Block, remove_block, removed_blocks
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.describe import folder_loaders
from slimkit.primitives.surgery import prune_layer
from tests.tiny import FAMILIES, model_output

IDS = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))


def _without_blocks(family: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family](layers=4)
    remove_block(model, Block(0, "attention"))
    remove_block(model, Block(2, "mlp"))
    remove_block(model, Block(3, "attention"))
    remove_block(model, Block(3, "mlp"))  # the whole layer
    prune_layer(model, "mlp_channel", 1, torch.arange(40))  # other removals compose
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_and_load_give_equal_outputs_without_the_blocks_weights(family, tmp_path, tokenizer):
    model = _without_blocks(family)
    before = model_output(model, IDS)
    path = slimkit.save(model, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["per_layer_config"]["0"]["num_attention_heads"] == 0
    assert config["per_layer_config"]["2"]["intermediate_size"] == 0
    assert "the attention blocks of layers 0, 3 and the MLP blocks of layers 2, 3 removed" in json.dumps(config)
    (weights,) = path.glob("*.safetensors")
    with safe_open(weights, "pt") as saved:
        names = set(saved.keys())
    assert not [n for n in names if n.startswith(("model.layers.0.self_attn.", "model.layers.0.input_layernorm."))]
    assert not [n for n in names if n.startswith(("model.layers.2.mlp.", "model.layers.3."))]
    loaded, _ = slimkit.load(path)
    assert removed_blocks(loaded) == removed_blocks(model)
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, IDS), before, rtol=0, atol=0)


def test_the_folder_says_plain_transformers_and_an_hf_export_cannot_read_it(tmp_path, tokenizer):
    path = slimkit.save(_without_blocks(), tokenizer, tmp_path / "m")
    verdicts = {v.loader: v for v in folder_loaders(path)}
    assert verdicts["slimkit.load"].ok
    assert not verdicts["transformers from_pretrained"].ok
    hf = verdicts["transformers via slimkit export --format hf"]
    assert not hf.ok and "a Hugging Face config has no layer without attention or without an MLP" in hf.detail
    assert "the attention blocks of layers 0, 3" in hf.detail and "the MLP blocks of layers 2, 3" in hf.detail
    gguf = verdicts["llama.cpp via slimkit export --format gguf"]
    assert gguf.ok and "gguf deci" in gguf.detail


def test_a_removed_block_record_on_an_architecture_without_blocks_is_refused(tmp_path, tokenizer, opt):
    path = slimkit.save(opt, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    widths = ModelView(opt).layer_widths()
    config["per_layer_config"] = {str(i): dict(w) for i, w in enumerate(widths)}
    config["per_layer_config"]["0"]["ffn_dim"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimkitError, match="cannot be removed from this model"):
        slimkit.load(path)
