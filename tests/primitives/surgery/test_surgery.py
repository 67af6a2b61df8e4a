"""Removing units equals zeroing their contribution (lossless surgery), on random inputs."""

from __future__ import annotations

import copy

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups, layer_group
from slimkit.primitives.surgery import SurgeryError, prune_layer, remove_units
from tests.tiny import model_output


def _zero_unit_outputs(model, kind: str, layer: int, units: list[int]) -> None:
    """Zero what the units write to the residual stream (o / down input columns)."""
    group = layer_group(model, kind, layer)
    with torch.no_grad():
        for member in group.members:
            if member.dim == 1 and member.param == "weight":  # o / down columns
                tensor = member.tensor(model)
                tensor[:, member.indices[units].reshape(-1)] = 0.0


@pytest.mark.parametrize("family", ["llama", "opt", "bert"])
@pytest.mark.parametrize(
    ("kind", "keep"),
    [("mlp_channel", [0, 5, 7, 20, 33]), ("kv_group", [1]), ("attention_head", [1, 2, 4, 5])],
)
def test_removal_equals_zeroing(family, kind, keep, request):
    model = request.getfixturevalue(family)
    ids = torch.randint(3, 200, (2, 11))
    group = layer_group(model, kind, 1)
    if kind == "attention_head" and family == "llama":
        keep = [1, 2, 4, 5]  # two of three query heads in each of the 2 KV groups (GQA parity)
    elif kind == "attention_head":
        keep = [0, 2, 3]
    dropped = sorted(set(range(group.size)) - set(keep))
    _zero_unit_outputs(model, kind, 1, dropped)
    zeroed = model_output(model, ids)
    remove_units(model, group, torch.tensor(keep))
    torch.testing.assert_close(model_output(model, ids), zeroed, rtol=1e-5, atol=1e-5)
    assert layer_group(model, kind, 1).size == len(keep)


def test_gqa_head_removal_updates_attributes_and_config(llama):
    prune_layer(llama, "attention_head", 0, torch.tensor([0, 1, 3, 4]))
    attention = llama.model.layers[0].self_attn
    view = ModelView(llama)
    assert (view.layer(0).num_heads, view.layer(0).num_kv_heads, attention.num_key_value_groups) == (4, 2, 2)
    assert llama.config.num_attention_heads == 6  # layers differ: the config keeps the dense value
    for index in (1, 2):
        prune_layer(llama, "attention_head", index, torch.tensor([0, 1, 3, 4]))
    assert (llama.config.num_attention_heads, llama.config.num_key_value_heads) == (4, 2)


def test_hidden_feature_removal_keeps_tying_and_runs(llama):
    group = build_groups(llama, "hidden_feature")[0]
    remove_units(llama, group, torch.arange(36))
    view = ModelView(llama)
    assert view.hidden_size == 36 and view.tied and llama.config.hidden_size == 36
    assert view.head.in_features == 36 and llama.model.norm.weight.shape == (36,)
    assert view.layer(2).linear("down").out_features == 36
    assert torch.isfinite(model_output(llama, torch.randint(3, 200, (1, 5)))).all()


def test_hidden_feature_removal_equals_zeroing_up_to_the_rms_scale(llama):
    """Removing features equals zeroing them everywhere, once each RMSNorm's weight absorbs the
    change of its mean over d features to a mean over d - k (with eps = 0 so the scale is exact)."""
    ids = torch.randint(3, 200, (2, 7))
    for module in llama.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.0
    pruned = copy.deepcopy(llama)
    dropped = torch.tensor([3, 17, 30])
    d = llama.config.hidden_size
    group = build_groups(llama, "hidden_feature")[0]
    with torch.no_grad():
        for member in group.members:
            tensor = member.tensor(llama)
            if "norm" in member.module:
                tensor.mul_(((d - len(dropped)) / d) ** 0.5)
            tensor.index_fill_(member.dim, member.indices[dropped].reshape(-1), 0.0)
    kept = torch.tensor(sorted(set(range(d)) - set(dropped.tolist())))
    remove_units(pruned, build_groups(pruned, "hidden_feature")[0], kept)
    torch.testing.assert_close(model_output(pruned, ids), model_output(llama, ids), rtol=1e-4, atol=1e-5)


def test_score_only_kinds_are_refused(llama):
    with pytest.raises(ValueError, match="cannot be removed"):
        remove_units(llama, layer_group(llama, "qk_dim", 0), torch.arange(2))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before, shapes):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    view = ModelView(model)
    assert [(layer.num_heads, layer.num_kv_heads, layer.mlp_width) for layer in view.layers] == shapes


@pytest.mark.parametrize(
    ("kind", "keep", "problem"),
    [
        # 2 KV groups of 3 query heads: 2 + 1 kept is uneven (this used to slice q and then raise)
        ("attention_head", [0, 1, 3], r"keeps \[2, 1\] query heads in the 2 KV groups"),
        # 3 + 1: an even total (4 heads over 2 KV heads) that would silently regroup the heads
        ("attention_head", [0, 1, 2, 3], r"keeps \[3, 1\] query heads"),
        ("attention_head", [0, 6], r"keep indices \[6\] are outside the group's 6 units"),
        ("mlp_channel", [0, -1], r"keep indices \[-1\] are outside"),
        ("mlp_channel", [3, 3, 5], r"repeats units \[3\]"),
        ("mlp_channel", [], "the keep set is empty"),
        ("kv_group", torch.tensor([True, False]), "boolean mask"),
        ("mlp_channel", torch.tensor([[0, 1]]), "must be 1-D"),
        ("mlp_channel", torch.tensor([0.5, 2.0]), "integer unit indices"),
    ],
)
def test_refused_keep_set_leaves_the_model_unchanged(llama, kind, keep, problem):
    group = layer_group(llama, kind, 1)
    before, view = _state(llama), ModelView(llama)
    shapes = [(layer.num_heads, layer.num_kv_heads, layer.mlp_width) for layer in view.layers]
    with pytest.raises(SurgeryError, match=rf"layer 1 {kind}: .*{problem}"):
        remove_units(llama, group, keep if isinstance(keep, torch.Tensor) else torch.tensor(keep, dtype=torch.long))
    _assert_unchanged(llama, before, shapes)
    assert isinstance(SurgeryError("x"), SlimkitError) and isinstance(SurgeryError("x"), ValueError)


def test_stale_group_is_refused_before_slicing(llama):
    """A group built before an earlier surgery of the same layer no longer matches the shapes."""
    stale = layer_group(llama, "mlp_channel", 0)
    prune_layer(llama, "mlp_channel", 0, torch.arange(40))
    before = _state(llama)
    shapes = [(layer.num_heads, layer.num_kv_heads, layer.mlp_width) for layer in ModelView(llama).layers]
    with pytest.raises(SurgeryError, match=r"layer 0 mlp_channel: .*built before an earlier surgery"):
        remove_units(llama, stale, torch.arange(30))
    _assert_unchanged(llama, before, shapes)


def test_even_gqa_keep_set_and_plain_lists_are_accepted(llama):
    remove_units(llama, layer_group(llama, "attention_head", 2), [0, 2, 4, 5])  # 2 + 2 over the KV groups
    layer = ModelView(llama).layer(2)
    assert (layer.num_heads, layer.num_kv_heads) == (4, 2)
