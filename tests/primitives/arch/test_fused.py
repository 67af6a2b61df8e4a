"""Fused projections as their parts (Phi-3's qkv_proj and gate_up_proj): hand-checked outputs, exactness against
the stock model, writing back the stock tensors, per-layer head counts and Phi-4-mini's partial rotary refusal."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Phi3ForCausalLM

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.capabilities import refusal
from slimkit.primitives.arch.fused import FusedLinear, fuse_tensors, fused_for_save, is_split, split_fused
from slimkit.primitives.arch.layer_config import LayerConfig
from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import export
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.surgery import prune_layer
from tests.tiny import byte_tokenizer, model_output, tiny_phi3

IDS = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(0))


def _stock(model: nn.Module) -> Phi3ForCausalLM:
    """The stock fused model with ``model``'s weights."""
    stock = Phi3ForCausalLM(model.config)
    with fused_for_save(model):
        stock.load_state_dict(model.state_dict())
    return stock.eval()


def test_fused_linear_concatenates_its_parts_in_order():
    first, second = nn.Linear(2, 1, bias=False), nn.Linear(2, 2, bias=True)
    with torch.no_grad():
        first.weight.copy_(torch.tensor([[1.0, 2.0]]))
        second.weight.copy_(torch.tensor([[0.0, 1.0], [3.0, 0.0]]))
        second.bias.copy_(torch.tensor([10.0, 20.0]))
    fused = FusedLinear({"a": first, "b": second})
    out = fused(torch.tensor([[1.0, -1.0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 9.0, 23.0]]))  # [1-2, -1+10, 3+20]
    assert (fused.in_features, fused.out_features, fused.part_names) == (2, 3, ("a", "b"))


def test_split_is_exact_and_idempotent():
    model = tiny_phi3(vocab_size=200)
    stock = _stock(model)
    assert not is_split(stock)
    expected = model_output(stock, IDS)
    split_fused(stock)
    assert is_split(stock) and isinstance(stock.model.layers[0].self_attn.qkv_proj, FusedLinear)
    attn = stock.model.layers[0].self_attn.qkv_proj
    assert [attn.get_submodule(p).out_features for p in attn.part_names] == [48, 16, 16]  # 6 x 8, 2 x 8, 2 x 8
    assert [p.out_features for p in stock.model.layers[0].mlp.gate_up_proj.children()] == [64, 64]
    torch.testing.assert_close(model_output(stock, IDS), expected, rtol=0, atol=0)
    parts = list(stock.model.layers[0].self_attn.qkv_proj.children())
    split_fused(stock)
    assert list(stock.model.layers[0].self_attn.qkv_proj.children()) == parts


def test_a_fused_model_is_refused_by_the_view_in_one_line():
    stock = _stock(tiny_phi3(vocab_size=200))
    with pytest.raises(SlimkitError, match=r"^this phi3 model holds fused projections \(self_attn.qkv_proj, mlp"):
        ModelView(stock)


def test_fused_for_save_writes_stock_names_and_gives_the_same_modules_back():
    model = tiny_phi3(vocab_size=200)
    qkv = model.model.layers[1].self_attn.qkv_proj
    weight = qkv.q_proj.weight
    expected = model_output(model, IDS)
    with fused_for_save(model):
        names = set(model.state_dict())
        assert "model.layers.1.self_attn.qkv_proj.weight" in names
        assert "model.layers.1.mlp.gate_up_proj.weight" in names
        assert not any(".q_proj." in name or ".gate_proj." in name for name in names)
    assert model.model.layers[1].self_attn.qkv_proj is qkv and qkv.q_proj.weight is weight
    torch.testing.assert_close(model_output(model, IDS), expected, rtol=0, atol=0)


def test_fuse_tensors_restores_the_stock_tensors():
    model = tiny_phi3(vocab_size=200)
    stock = _stock(model)
    tensors = fuse_tensors(dict(model.state_dict()), model)
    assert set(tensors) == set(stock.state_dict())
    for name, tensor in stock.state_dict().items():
        torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0)


def test_per_layer_heads_live_in_each_attention_modules_own_config():
    model = tiny_phi3(vocab_size=200)
    prune_layer(model, "attention_head", 2, torch.tensor([0, 2, 3, 5]))
    prune_layer(model, "kv_group", 0, torch.tensor([1]))
    attn = [layer.self_attn for layer in model.model.layers]
    assert isinstance(attn[2].config, LayerConfig) and attn[2].config.num_attention_heads == 4
    assert (attn[0].config.num_attention_heads, attn[0].config.num_key_value_heads) == (3, 1)
    assert model.config.num_attention_heads == 6 and attn[1].config.num_attention_heads == 6
    model.set_attn_implementation("eager")  # a later change of the model's config reaches every layer's
    assert all(a.config._attn_implementation == "eager" for a in attn)
    twin = copy.deepcopy(model)
    assert twin.model.layers[2].self_attn.config.base is twin.config
    torch.testing.assert_close(model_output(twin, IDS), model_output(model, IDS), rtol=0, atol=0)


def test_per_layer_widths_reload_and_uniform_ones_save_a_stock_folder(tmp_path):
    model = tiny_phi3(vocab_size=len(byte_tokenizer()) + 1)
    prune_layer(model, "attention_head", 1, torch.tensor([0, 2, 3, 5]))
    expected = model_output(model, IDS)
    loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / "varying"))
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, IDS), expected, rtol=0, atol=0)

    uniform = tiny_phi3(vocab_size=len(byte_tokenizer()) + 1)
    for index in range(3):
        prune_layer(uniform, "mlp_channel", index, torch.arange(40))
        prune_layer(uniform, "kv_group", index, torch.tensor([0]))
    expected = model_output(uniform, IDS)
    folder = slimkit.save(uniform, byte_tokenizer(), tmp_path / "uniform")
    stock = Phi3ForCausalLM.from_pretrained(folder).eval()  # a plain folder: stock transformers reads it
    assert stock.config.num_attention_heads == 3 and stock.config.intermediate_size == 40
    torch.testing.assert_close(model_output(stock, IDS), expected, rtol=0, atol=1e-6)
    reloaded, _ = slimkit.load(folder)
    torch.testing.assert_close(model_output(reloaded, IDS), expected, rtol=0, atol=1e-6)


def test_partial_rotary_refuses_dimensions_inside_heads_not_whole_heads():
    partial = tiny_phi3(vocab_size=200, partial_rotary_factor=0.5)
    with pytest.raises(SlimkitError, match=r"^qk_dim groups are not supported for phi3: where its partial_rotary_fa"):
        build_groups(partial, "qk_dim")
    assert layer_group(partial, "attention_head", 0).size == 6
    assert len(build_groups(tiny_phi3(vocab_size=200), "qk_dim")) == 3  # full rotary: j pairs with j + d/2
    assert refusal(ARCH_SPECS["phi3"], "qk_dim") is not None  # the table states the condition
    assert refusal(ARCH_SPECS["phi3"], "qk_dim", tiny_phi3(vocab_size=200).config) is None


def test_longrope_and_partial_rotary_are_constants_pruned_heads_keep(tmp_path):
    """Phi-4-mini's shape: longrope factors over a half-rotated head. Pruned KV groups reload exactly; the plain
    folder is refused in one line (transformers checks the factors against hidden_size // heads, not head_dim)."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5],
        "long_factor": [2.0, 3.0],
        "original_max_position_embeddings": 64,
    }
    model = tiny_phi3(vocab_size=len(byte_tokenizer()) + 1)
    config = type(model.config)(**{**model.config.to_dict(), "rope_parameters": rope})
    model = split_fused(Phi3ForCausalLM(config)).eval()
    for index in range(3):
        prune_layer(model, "kv_group", index, torch.tensor([1]))
    expected = model_output(model, IDS)
    loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / "m"))
    torch.testing.assert_close(model_output(loaded, IDS), expected, rtol=0, atol=0)
    with pytest.raises(
        SlimkitError, match=r"^Phi3Config refuses these widths \(.*short_factor.*\); use --format gguf or slimkit.load"
    ):
        export(model, tmp_path / "hf", "hf", tokenizer=byte_tokenizer())


def test_offloaded_loading_for_compression_is_refused_in_one_line(tmp_path):
    model = tiny_phi3(vocab_size=len(byte_tokenizer()) + 1)
    folder = slimkit.save(model, byte_tokenizer(), tmp_path / "m")  # uniform widths: a stock fused folder
    with pytest.raises(SlimkitError, match=r"^.*: a phi3 model is compressed with its fused projections .* max_memory"):
        slimkit.load(folder, max_memory="1GiB")
