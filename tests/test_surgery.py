"""Removing structure equals zeroing it out (lossless surgery), on random inputs."""

from __future__ import annotations

import torch
from slimkit.primitives.arch import ModelView
from slimkit.primitives.surgery import prune_attention_heads, prune_mlp_channels, slice_linear


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_slice_linear_hand_case():
    linear = torch.nn.Linear(3, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(12.0).reshape(4, 3))
        linear.bias.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    new = slice_linear(linear, keep_out=torch.tensor([3, 1]), keep_in=torch.tensor([0, 2]))
    assert new.weight.tolist() == [[9.0, 11.0], [3.0, 5.0]]
    assert new.bias.tolist() == [40.0, 20.0]


def test_mlp_channel_removal_equals_zeroing(llama):
    ids = torch.randint(3, 200, (2, 11))
    view = ModelView(llama)
    layer = view.layer(1)
    keep = torch.tensor([0, 5, 7, 20, 33, 63])
    drop = torch.tensor(sorted(set(range(layer.mlp_width)) - set(keep.tolist())))
    with torch.no_grad():
        layer.linear("down").weight[:, drop] = 0.0
    zeroed = _logits(llama, ids)
    prune_mlp_channels(layer, keep)
    assert view.layer(1).mlp_width == 6
    torch.testing.assert_close(_logits(llama, ids), zeroed, rtol=1e-5, atol=1e-5)


def test_kv_group_removal_equals_zeroing_its_heads(llama):
    ids = torch.randint(3, 200, (2, 11))
    view = ModelView(llama)
    layer = view.layer(0)
    d, group = layer.head_dim, layer.num_heads // layer.num_kv_heads  # 8, 3
    removed_q_heads = range(0 * group, 1 * group)  # KV group 0 and its three query heads
    with torch.no_grad():
        for h in removed_q_heads:
            layer.linear("o").weight[:, h * d : (h + 1) * d] = 0.0
    zeroed = _logits(llama, ids)
    prune_attention_heads(layer, torch.tensor([1]))
    assert (view.layer(0).num_heads, view.layer(0).num_kv_heads) == (3, 1)
    assert llama.model.layers[0].self_attn.num_key_value_groups == 3
    torch.testing.assert_close(_logits(llama, ids), zeroed, rtol=1e-5, atol=1e-5)
