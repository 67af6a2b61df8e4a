"""Removed attention / MLP blocks in export: llama.cpp's deci layers with zero heads or zero feed-forward width
(its graph skips both) give the PyTorch logits; a plain Hugging Face folder is refused in one line."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.blocks import Block, remove_block
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import export
from slimkit.primitives.surgery import prune_layer
from tests.primitives.export.test_export import _field, _no_partials, assert_llamacpp_matches
from tests.tiny import bpe_tokenizer, tiny_llama, tiny_qwen2

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")


def _without_blocks(model: torch.nn.Module) -> torch.nn.Module:
    remove_block(model, Block(0, "attention"))  # the first layer: written as one zero head (llama.cpp needs one)
    remove_block(model, Block(1, "mlp"))
    remove_block(model, Block(3, "attention"))
    remove_block(model, Block(3, "mlp"))  # a whole layer
    return model


@pytest.mark.slow
@pytest.mark.parametrize("type", ["f32", "q8_0"])
def test_attention_free_and_mlp_free_layers_are_deci_and_llamacpp_matches(tmp_path, type):
    torch.manual_seed(0)
    model = _without_blocks(tiny_llama(layers=5))
    prune_layer(model, "mlp_channel", 2, torch.arange(32))
    path = tmp_path / "blocks.gguf"
    result = export(model, path, "gguf", type, tokenizer=bpe_tokenizer())
    assert result.architecture == "deci"
    assert list(_field(path, "deci.attention.head_count")) == [1, 6, 6, 0, 6]
    assert list(_field(path, "deci.attention.head_count_kv")) == [1, 2, 2, 0, 2]
    assert any(
        w.startswith("layer 0's attention block was removed: written as one attention head") for w in result.warnings
    )
    assert result.added_params == (4 * 48 * 8 + 48) + (3 * 48 + 48)
    # layer 1 keeps its attention: its removed MLP is written as a zero feed-forward of width 1 (llama.cpp's deci
    # graph drops the attention output of a layer with feed-forward length 0); layer 3 has neither block
    assert list(_field(path, "deci.feed_forward_length")) == [64, 1, 32, 0, 64]
    assert any(
        w.startswith("the MLP blocks of layers 1 were removed: written as feed-forwards") for w in result.warnings
    )
    assert_llamacpp_matches(model, path, type)


@pytest.mark.slow
def test_a_saved_and_reloaded_model_exports_the_same_file(tmp_path):
    torch.manual_seed(0)
    model = _without_blocks(tiny_llama(layers=4))
    loaded, tokenizer = slimkit.load(slimkit.save(model, bpe_tokenizer(), tmp_path / "m"))
    path = tmp_path / "reloaded.gguf"
    export(loaded, path, "gguf", "f32", tokenizer=tokenizer)
    assert_llamacpp_matches(model, path, "f32", ids=list(range(3, 40)))


def test_a_plain_hf_folder_is_refused_in_one_line(tmp_path):
    model = _without_blocks(tiny_llama(layers=4))
    with pytest.raises(SlimkitError) as refused:
        export(model, tmp_path / "hf", "hf", tokenizer=bpe_tokenizer())
    message = str(refused.value)
    assert "\n" not in message and "a Hugging Face config has no layer without attention or without an MLP" in message
    assert message.startswith("the attention blocks of layers 0, 3 and the MLP blocks of layers 1, 3 removed")
    assert not (tmp_path / "hf").exists() and _no_partials(tmp_path)


def test_a_qwen2_model_with_removed_blocks_is_refused_for_gguf(tmp_path):
    model = tiny_qwen2(layers=3)
    remove_block(model, Block(1, "mlp"))
    with pytest.raises(SlimkitError, match=r"deci architecture .* has no q/k/v biases"):
        export(model, tmp_path / "q.gguf", "gguf", "f32", tokenizer=bpe_tokenizer())
    assert not (tmp_path / "q.gguf").exists()
