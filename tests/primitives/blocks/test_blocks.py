"""Whole attention / MLP blocks as units: removing one equals skipping it, generation keeps working, the search
picks what a brute-force search picks. Tiny llama: an attention block holds 6,192 parameters (q 48x48, k and v
16x48, o 48x48, its norm 48), an MLP block 9,264 (3 x 48x64, its norm 48)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from slimkit.primitives.arch import ModelView, RemovedAttention, RemovedMLP
from slimkit.primitives.blocks import (
    Block,
    LayerLoss,
    block_params,
    check_blocks,
    remove_block,
    removed_blocks,
    search_blocks,
    without_block,
)
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.groups import build_groups
from tests.tiny import FAMILIES, model_output, tiny_llama, tiny_opt

IDS = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))


def _zero_branch(module: nn.Module):
    """A forward hook making a block's branch add nothing (the reference for 'skipped')."""

    def hook(_module, _args, output):
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_removing_a_block_equals_a_branch_that_adds_nothing(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    layers = model.model.layers
    handles = [_zero_branch(layers[0].self_attn), _zero_branch(layers[2].mlp)]
    expected = model_output(model, IDS)
    for handle in handles:
        handle.remove()
    before = params_by_part(model)["total"]
    sizes = [block_params(model, Block(0, "attention")), block_params(model, Block(2, "mlp"))]
    remove_block(model, Block(0, "attention"))
    remove_block(model, Block(2, "mlp"))
    assert torch.equal(model_output(model, IDS), expected)
    assert params_by_part(model)["total"] == before - sum(sizes)
    assert removed_blocks(model) == [Block(0, "attention"), Block(2, "mlp")]
    names = set(model.state_dict())
    assert not [n for n in names if n.startswith(("model.layers.0.self_attn.", "model.layers.0.input_layernorm."))]
    assert not [n for n in names if n.startswith(("model.layers.2.mlp.", "model.layers.2.post_attention_layernorm."))]


def test_block_sizes_of_the_tiny_llama():
    model = tiny_llama()
    assert block_params(model, Block(1, "attention")) == 6_192
    assert block_params(model, Block(1, "mlp")) == 9_264


def test_a_layer_without_both_blocks_equals_the_model_without_that_layer():
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    shorter = tiny_llama(layers=3)
    kept = [0, 2, 3]
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index == 1:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{kept.index(index)}.", 1)
        state[name] = tensor
    shorter.load_state_dict(state)
    remove_block(model, Block(1, "attention"))
    remove_block(model, Block(1, "mlp"))
    torch.testing.assert_close(model_output(model, IDS), model_output(shorter, IDS), rtol=0, atol=1e-6)
    view = ModelView(model)
    assert view.layer(1).roles == () and view.layer(1).widths()["num_attention_heads"] == 0


def test_the_view_groups_and_counts_skip_removed_blocks():
    model = tiny_llama()
    remove_block(model, Block(1, "attention"))
    remove_block(model, Block(0, "mlp"))
    view = ModelView(model)
    assert view.layer(1).widths() == {
        "num_attention_heads": 0,
        "num_key_value_heads": 0,
        "head_dim": 8,
        "intermediate_size": 64,
    }
    assert view.layer(0).mlp_width == 0 and view.layer(0).roles == ("q", "k", "v", "o")
    assert [g.layer for g in build_groups(model, "attention_head")] == [0, 2]
    assert [g.layer for g in build_groups(model, "mlp_channel")] == [1, 2]
    assert isinstance(view.layer(1).attention, RemovedAttention)
    assert isinstance(model.model.layers[0].mlp, RemovedMLP)


def test_without_block_restores_the_same_modules():
    model = tiny_llama()
    attention, norm = model.model.layers[1].self_attn, model.model.layers[1].input_layernorm
    expected = model_output(model, IDS)
    with without_block(model, Block(1, "attention")):
        assert isinstance(model.model.layers[1].self_attn, RemovedAttention)
    assert model.model.layers[1].self_attn is attention and model.model.layers[1].input_layernorm is norm
    assert torch.equal(model_output(model, IDS), expected)


def test_generation_with_the_kv_cache_equals_generation_without_it():
    """The first layer's attention is gone: its cache entry still counts the tokens, so positions stay right."""
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    remove_block(model, Block(0, "attention"))
    remove_block(model, Block(2, "mlp"))
    prompt = IDS[:1, :6]
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        uncached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
        assert torch.equal(cached, uncached)
        out = model(prompt, use_cache=True)
        step = model(cached[:, 6:7], past_key_values=out.past_key_values, use_cache=True)
        assert out.past_key_values.get_seq_length() == 7
        full = model(cached[:, :7]).logits[:, -1]
    torch.testing.assert_close(step.logits[:, -1], full, rtol=0, atol=1e-5)


def test_a_plan_that_removes_every_block_of_a_kind_is_refused():
    model = tiny_llama()
    with pytest.raises(SlimkitError, match="would leave no attention block"):
        check_blocks(model, [Block(i, "attention") for i in range(3)])
    with pytest.raises(SlimkitError, match="each block once"):
        check_blocks(model, [Block(0, "mlp"), Block(0, "mlp")])
    check_blocks(model, [Block(0, "attention"), Block(1, "attention"), Block(0, "mlp")])
    remove_block(model, Block(0, "mlp"))
    with pytest.raises(SlimkitError, match="already removed"):
        remove_block(model, Block(0, "mlp"))


def test_an_architecture_without_removable_blocks_is_refused_in_one_line():
    with pytest.raises(SlimkitError, match="cannot be removed from this model: opt layers hold") as refused:
        remove_block(tiny_opt(), Block(0, "mlp"))
    assert "\n" not in str(refused.value)


# -- the search ---------------------------------------------------------------------------------


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (2, 16), generator=generator) for _ in range(2)]


def _full_loss(model: nn.Module, batches: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch).logits[:, :-1].float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            count += batch[:, 1:].numel()
    return float(total) / count


def test_the_loss_from_any_layer_equals_the_full_forward():
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    loss = LayerLoss(model, _batches())
    expected = _full_loss(model, _batches())
    for start in range(4):
        assert loss.from_layer(start) == pytest.approx(expected, rel=1e-5)


def test_the_search_removes_what_a_brute_force_search_removes():
    torch.manual_seed(0)
    model = tiny_llama(layers=4)
    reference = tiny_llama(layers=4)
    reference.load_state_dict(model.state_dict())
    batches = _batches()
    result = search_blocks(model, batches, ["attention", "mlp"], range(4), count=3)
    assert result.loss_before == pytest.approx(_full_loss(reference, batches), rel=1e-5)
    for step in result.steps:
        losses = {}
        for layer in range(4):
            for kind in ("attention", "mlp"):
                block = Block(layer, kind)
                if block in removed_blocks(reference):
                    continue
                with without_block(reference, block):
                    losses[block] = _full_loss(reference, batches)
        best = min(losses, key=losses.get)
        assert step.block == best and step.loss == pytest.approx(losses[best], rel=1e-5)
        assert step.tried == len(losses) and step.perplexity == pytest.approx(math.exp(step.loss))
        remove_block(reference, best)
    assert removed_blocks(model) == removed_blocks(reference)
    torch.testing.assert_close(model_output(model, IDS), model_output(reference, IDS), rtol=0, atol=1e-6)


def test_a_parameter_limit_only_tries_blocks_that_fit_and_keeps_one_of_each_kind():
    small = search_blocks(tiny_llama(layers=3), _batches(), ["attention", "mlp"], range(3), limit=9_000)
    assert [step.block.kind for step in small.steps] == ["attention"]  # an MLP block (9,264) never fits
    assert small.steps[0].tried == 3 and small.removed_params == 6_192
    every = search_blocks(tiny_llama(layers=3), _batches(), ["attention"], range(3), limit=3 * 6_192)
    assert len(every.steps) == 2  # the third attention block stays
    with pytest.raises(SlimkitError, match="found 2 of 3 blocks"):
        search_blocks(tiny_llama(layers=3), _batches(), ["attention"], range(3), count=3)
