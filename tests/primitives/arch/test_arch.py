"""ModelView adapters on tiny configs of each supported family."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.arch import ARCH_SPECS, ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.surgery import prune_layer


def test_llama_view_reads_gqa_widths(llama):
    view = ModelView(llama)
    assert view.num_layers == 3
    layer = view.layer(0)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (6, 2, 8)
    assert layer.mlp_kind == "gated" and layer.mlp_width == 64
    assert layer.rope is True
    assert layer.attn_norm.kind == "rmsnorm" and layer.attn_norm.placement == "pre"
    assert layer.linear("q") is llama.model.layers[0].self_attn.q_proj
    assert layer.linear("gate") is llama.model.layers[0].mlp.gate_proj
    assert view.tied and view.hidden_size == 48
    assert view.final_norm.module is llama.model.norm
    assert view.activation == "silu"


def test_opt_view(opt):
    view = ModelView(opt)
    layer = view.layer(1)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (4, 4, 8)
    assert layer.mlp_kind == "plain" and layer.roles == ("q", "k", "v", "o", "up", "down")
    assert layer.linear("up") is opt.model.decoder.layers[1].fc1
    assert layer.linear("o") is opt.model.decoder.layers[1].self_attn.out_proj
    assert layer.attn_norm.kind == "layernorm" and layer.attn_norm.placement == "pre"
    assert not layer.rope
    assert view.final_norm.module is opt.model.decoder.final_layer_norm


def test_bert_view(bert):
    view = ModelView(bert)
    layer = view.layer(0)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (4, 4, 8)
    assert layer.linear("o") is bert.encoder.layer[0].attention.output.dense
    assert layer.linear("up") is bert.encoder.layer[0].intermediate.dense
    assert layer.attn_norm.placement == "post"
    assert view.head is None and view.final_norm is None and not view.tied


def test_unknown_model_type_is_one_clear_line():
    class Fake(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt9"})()

    supported = ", ".join(sorted(ARCH_SPECS))
    with pytest.raises(SlimkitError, match=rf"^model_type 'gpt9' is not supported; supported: {supported}$"):
        ModelView(Fake())


@pytest.mark.parametrize("family", ["llama", "opt", "bert"])
def test_view_follows_surgery(family, request):
    model = request.getfixturevalue(family)
    view = ModelView(model)
    layer = view.layer(0)
    prune_layer(model, "mlp_channel", 0, torch.arange(0, layer.mlp_width, 2))
    groups = layer.num_kv_heads
    prune_layer(model, "kv_group", 0, torch.arange(groups - 1))
    assert view.layer(0).mlp_width == (64 if family == "llama" else 48) // 2
    assert view.layer(0).num_kv_heads == groups - 1
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        out = model(ids)
    assert torch.isfinite(out[0]).all()


def test_linears_maps_every_projection_to_its_path(llama):
    view = ModelView(llama)
    found = view.linears()
    assert len(found) == view.num_layers * 7  # q, k, v, o, gate, up, down
    assert all(llama.get_submodule(path) is module for path, module in found.items())
    assert list(view.linears([view.layer(1)])) == [p for p in found if p.startswith("model.layers.1.")]
