"""Attentions that derive their head width from the config (OPT, BERT): the build values, the saved widths, and
save/reload round trips of uniformly pruned heads (a count that does not divide the hidden size; one that divides
it into heads of another width; a narrower hidden size) with equal outputs."""

from __future__ import annotations

import json

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.derived_head_dim import build_values, saved_head_dims, set_saved_head_dims
from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.surgery import prune_layer, remove_units
from tests.tiny import byte_tokenizer, model_output, tiny_bert, tiny_llama, tiny_opt

OPT, BERT, LLAMA = ARCH_SPECS["opt"], ARCH_SPECS["bert"], ARCH_SPECS["llama"]


def test_the_specs_that_derive_the_head_width():
    assert OPT.head_dim_from_hidden and BERT.head_dim_from_hidden
    assert not any(ARCH_SPECS[t].head_dim_from_hidden for t in ("llama", "qwen2", "gemma3_text", "mixtral"))


@pytest.mark.parametrize(
    ("hidden", "heads", "head_dims", "expected"),
    [
        (32, 4, {0: 8, 1: 8}, {}),  # 32 / 4 = 8: the saved config builds heads of 8
        (32, 3, {0: 8, 1: 8}, {"num_attention_heads": 1}),  # 3 does not divide 32
        (32, 2, {0: 8, 1: 8}, {"num_attention_heads": 1}),  # 2 divides 32 into heads of 16, not 8
        (28, 4, {0: 8}, {"num_attention_heads": 1}),  # a narrower stream: 28 / 4 = 7
        (32, 4, {}, {}),
    ],
)
def test_build_values_by_hand(hidden, heads, head_dims, expected):
    config = {"hidden_size": hidden, "num_attention_heads": heads}
    assert build_values(OPT, config, head_dims) == expected
    assert build_values(LLAMA, config, head_dims) == {}  # Llama's attention reads head_dim from the config


def test_saved_head_dims_skip_removed_attention_and_refuse_a_missing_width():
    per_layer = {"0": {"num_attention_heads": 3, "head_dim": 8}, "1": {"num_attention_heads": 0, "head_dim": 8}}
    assert saved_head_dims(OPT, per_layer, "config.json") == {0: 8}
    for bad in (None, 0, 8.0, "8"):
        entry = {"num_attention_heads": 3} if bad is None else {"num_attention_heads": 3, "head_dim": bad}
        with pytest.raises(SlimkitError, match=r"^config.json: per_layer_config layer 0 needs head_dim as a pos"):
            saved_head_dims(OPT, {"0": entry}, "config.json")


def test_set_head_dim_sets_the_width_and_the_scale_the_forward_reads():
    model = tiny_opt(layers=1)
    set_saved_head_dims(model, {0: 4})
    attention = ModelView(model).layer(0).attention
    assert (attention.head_dim, attention.scaling) == (4, 4**-0.5)
    with pytest.raises(SlimkitError, match=r"^llama attentions take their head width from the config"):
        ModelView(tiny_llama(layers=1)).layer(0).set_head_dim(4)
    set_saved_head_dims(tiny_llama(layers=1), {0: 4})  # nothing to do for Llama


def _uniform_heads(model, keep: list[int]) -> None:
    for layer in ModelView(model).layers:
        prune_layer(model, "attention_head", layer.index, torch.tensor(keep))


@pytest.mark.parametrize("family", ["opt", "bert"])
@pytest.mark.parametrize("keep", [[0, 2, 3], [1, 3]], ids=["3-of-4", "2-of-4"])
def test_uniformly_pruned_heads_reload_with_equal_outputs(family, keep, tmp_path):
    """4 heads of 8 over a hidden size of 32: 3 kept do not divide it, 2 kept divide it into heads of 16."""
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = (tiny_opt if family == "opt" else tiny_bert)(vocab_size=len(tokenizer) + 1)
    _uniform_heads(model, keep)
    assert model.config.num_attention_heads == len(keep)  # surgery wrote the uniform count into the config
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    before = model_output(model, ids)
    path = slimkit.save(model, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["num_attention_heads"] == len(keep) and config["hidden_size"] == 32
    loaded, _ = slimkit.load(path)
    assert loaded.config.num_attention_heads == len(keep)
    for layer in ModelView(loaded).layers:
        assert (layer.num_heads, layer.head_dim, layer.attention.scaling) == (len(keep), 8, 8**-0.5)
    assert ModelView(loaded).layer_widths() == ModelView(model).layer_widths()
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


def test_opt_with_a_narrower_stream_and_fewer_heads_reloads_with_equal_logits(tmp_path):
    """Hidden 32 -> 28 (no head count divides it into heads of 8) and 3 heads of 8 in every layer."""
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = tiny_opt(vocab_size=len(tokenizer) + 1)
    _uniform_heads(model, [0, 1, 3])
    (group,) = build_groups(model, "hidden_feature")
    remove_units(model, group, torch.arange(4, 32))
    ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    before = model_output(model, ids)
    loaded, _ = slimkit.load(slimkit.save(model, tokenizer, tmp_path / "m"))
    assert ModelView(loaded).hidden_size == 28 and ModelView(loaded).layer(0).head_dim == 8
    torch.testing.assert_close(model_output(loaded, ids), before, rtol=0, atol=0)


def test_a_saved_width_edited_out_is_one_line_before_any_weight_is_read(tmp_path):
    tokenizer = byte_tokenizer()
    model = tiny_opt(vocab_size=len(tokenizer) + 1)
    _uniform_heads(model, [0, 2, 3])
    path = slimkit.save(model, tokenizer, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["per_layer_config"]["1"]["head_dim"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimkitError, match=r"per_layer_config layer 1 needs head_dim as a positive integer, got None"):
        slimkit.load(path)
