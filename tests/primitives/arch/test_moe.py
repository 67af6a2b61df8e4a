"""MoE architecture knowledge: router, fused experts and config keys of each MoE family, read from the tensors."""

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.moe import MOE_SPECS, check_all_sparse, moe_blocks
from slimkit.primitives.arch.support import SUPPORTED, check_supported
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.experts import ExpertWeights, routed_output
from tests.tiny import MOE_FAMILIES


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_blocks_read_counts_and_widths_from_tensors(family):
    model = MOE_FAMILIES[family](experts=6, top_k=2)
    spec = MOE_SPECS[family]
    check_supported(model.config)
    assert family in SUPPORTED["causal-lm"]
    blocks = moe_blocks(model)
    assert [b.index for b in blocks] == [0, 1]
    block = blocks[0]
    assert (block.num_experts, block.top_k) == (6, 2)
    assert block.width == getattr(model.config, spec.width_key)
    assert block.renormalises == (family in ("mixtral", "qwen3_moe"))
    view = ModelView(model)
    assert view.layer(0).roles == ("q", "k", "v", "o")
    assert view.layer(0).widths()[spec.count_key] == 6
    # every MoE parameter (router, experts, shared expert) counts as MLP
    mlp = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)
    assert params_by_part(model)["mlp"] == mlp


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_routed_output_matches_the_model_block(family):
    model = MOE_FAMILIES[family]()
    block = moe_blocks(model)[0]
    x = torch.randn(20, model.config.hidden_size)
    with torch.no_grad():
        expected = block.module(x[None])[0]
        if block.shared_expert is not None:
            expected = expected - torch.sigmoid(block.module.shared_expert_gate(x)) * block.shared_expert(x)
        torch.testing.assert_close(routed_output(ExpertWeights.of(block), x), expected, rtol=0, atol=1e-5)


def test_dense_mlp_layers_among_moe_ones_are_refused():
    model = MOE_FAMILIES["qwen3_moe"]()
    check_all_sparse(model.config)
    model.config.mlp_only_layers = [1]
    with pytest.raises(SlimkitError, match="mlp_only_layers"):
        check_all_sparse(model.config)


def test_dense_model_has_no_moe_blocks():
    from tests.tiny import tiny_llama

    with pytest.raises(SlimkitError, match="no routed experts"):
        moe_blocks(tiny_llama())


def test_macs_count_the_router_and_the_top_k_experts_by_hand():
    from slimkit.primitives.evaluate.counting import count_macs

    model = MOE_FAMILIES["qwen3_moe"](vocab_size=300, experts=8, top_k=2)
    attention = 32 * 32 + 2 * (32 * 16) + 32 * 32  # q, k, v (2 KV heads of 8), o
    moe = 8 * 32 + 2 * 3 * 32 * 16  # router rows + two experts' gate, up, down
    scores = 2 * 4 * 8  # QK^T and AV: heads x head_dim for one token
    assert count_macs(model, seq_len=1) == 2 * (attention + moe + scores) + 300 * 32
