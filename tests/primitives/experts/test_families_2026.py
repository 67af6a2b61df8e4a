"""The routers, expert layouts and units of DeepSeek-V3, GLM-4.5, GPT-OSS and Llama 4 on tiny random models: the
pure routed output equals each model's MoE block, removing experts the router never picks (and channels whose down
columns are zero) leaves the logits unchanged, group-limited routers keep the same count in every group, and merging
keeps every per-expert tensor."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.expert_layout import from_rows, to_rows
from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.calibration.routing import collect_routing
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts import ExpertWeights, keep_experts, routed_output
from slimkit.primitives.experts.channels import keep_expert_channels
from slimkit.primitives.experts.merge import assign_dropped, merged_weights, set_expert_weights
from slimkit.primitives.experts.routers import Router, balanced_keep_top, check_groups, route
from slimkit.primitives.experts.scores import naee_search
from tests.tiny import MOE_2026, byte_tokenizer, model_output

FAMILIES = sorted(MOE_2026)
VOCAB = len(byte_tokenizer()) + 1


def _ids(seed: int = 0, length: int = 11) -> torch.Tensor:
    return torch.randint(3, 200, (2, length), generator=torch.Generator().manual_seed(seed))


def _shared(block, x):
    return torch.zeros_like(x) if block.shared_expert is None else block.shared_expert(x)


@pytest.mark.parametrize("family", FAMILIES)
def test_routed_output_matches_the_model_block(family):
    model = MOE_2026[family]()
    block = moe_blocks(model)[0]
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = block.module(x[None] if family != "llama4_text" else x)
        out = out[0] if isinstance(out, tuple) else out
        expected = out.reshape(20, -1) - _shared(block, x)
        torch.testing.assert_close(routed_output(ExpertWeights.of(block), x), expected, rtol=0, atol=2e-5)


def test_layouts_convert_exactly_by_hand():
    """GPT-OSS: gate at even columns, up at odd ones, applied as x @ W (+ bias)."""
    gate_up = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # 2 experts, hidden 3, width 2
    down = torch.arange(2 * 2 * 3.0).reshape(2, 2, 3)
    bias = torch.arange(8.0).reshape(2, 4)
    rows = to_rows("interleaved_columns", gate_up, down, bias)
    assert rows.gate[0].tolist() == [[0.0, 4.0, 8.0], [2.0, 6.0, 10.0]]  # columns 0 and 2, as rows
    assert rows.up_bias[1].tolist() == [5.0, 7.0]
    assert rows.down[1].tolist() == down[1].T.tolist()
    back = from_rows("interleaved_columns", rows)
    assert torch.equal(back[0], gate_up) and torch.equal(back[1], down) and torch.equal(back[2], bias)
    back = from_rows("columns", to_rows("columns", gate_up, down))
    assert torch.equal(back[0], gate_up) and torch.equal(back[1], down)


def test_group_limited_routing_by_hand():
    """4 experts in 2 groups, 1 group a token: the group with the larger best-two sum wins, then its top-1."""
    router = Router(torch.eye(4), "sigmoid_grouped", 1, renormalise=False, scale=2.0, groups=2, top_groups=1)
    x = torch.tensor([[3.0, -3.0, 1.0, 1.5]])  # group 0: 0.95 + 0.05; group 1: 0.73 + 0.82 (wins)
    chosen = route(router, x)
    assert chosen.index.tolist() == [[3]]
    assert chosen.weight.item() == pytest.approx(2.0 * float(torch.sigmoid(torch.tensor(1.5))))
    assert check_groups(router, [0, 1, 2, 3]) is None
    assert "every group must keep the same number" in (check_groups(router, [0, 1, 2]) or "")
    assert balanced_keep_top(torch.tensor([0.1, 0.9, 0.8, 0.2, 0.3, 0.4, 0.5, 0.6]), 4, 2) == [1, 2, 6, 7]


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_experts_the_router_never_picks_leaves_logits_unchanged(family):
    model = MOE_2026[family](vocab_size=VOCAB)
    ids = _ids(length=3)  # 6 tokens: some experts go unpicked
    before = model_output(model, ids)
    stats = collect_routing(model, [ids])
    for block in moe_blocks(model):
        groups = block.router_groups
        used = stats[block.index].counts > 0
        # keep the used ones, topped up to an even count per group (the most-scored unused ones)
        scores = used.double() * 10 + stats[block.index].probability.double()
        per_group = max(2 if groups > 1 else block.top_k, max(int(used.view(groups, -1).sum(1).max()), 1))
        kept = balanced_keep_top(scores, per_group * groups, groups)
        assert set(used.nonzero().flatten().tolist()) <= set(kept)
        if len(kept) == block.num_experts:
            continue
        keep_experts(block, kept)
    torch.testing.assert_close(model_output(model, ids), before, rtol=0, atol=1e-5)


def test_a_group_limited_router_refuses_unbalanced_kept_sets():
    block = moe_blocks(MOE_2026["deepseek_v3"]())[0]
    with pytest.raises(SlimkitError, match=r"^layer 1: the router picks among 2 groups of 4 experts \(n_group\)"):
        keep_experts(block, [0, 1, 2, 4, 5])
    assert block.num_experts == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_channels_whose_down_columns_are_zero_go_without_a_trace(family, tmp_path):
    model = MOE_2026[family](vocab_size=VOCAB)
    ids = _ids()
    keep = torch.tensor([1, 2, 5, 8, 9, 12, 13, 15])
    for block in moe_blocks(model):
        rows = block.rows()
        mask = torch.ones(rows.width, dtype=torch.bool)
        mask[keep] = False
        down = rows.down.clone()
        down[:, :, mask] = 0.0
        block.set_rows(type(rows)(rows.gate, rows.up, down, rows.gate_bias, rows.up_bias, rows.down_bias))
    before = model_output(model, ids)
    for block in moe_blocks(model):
        keep_expert_channels(block, keep.expand(block.num_experts, -1))
        assert block.width == 8
    after = model_output(model, ids)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    loaded, _ = slimkit.load(slimkit.save(model, byte_tokenizer(), tmp_path / "m"))
    torch.testing.assert_close(model_output(loaded, ids), after, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_naee_and_merging_keep_every_per_expert_tensor(family):
    torch.manual_seed(0)
    model = MOE_2026[family](vocab_size=VOCAB)
    block = moe_blocks(model)[0]
    weights = ExpertWeights.of(block)
    x = torch.randn(30, model.config.hidden_size)
    keep = block.num_experts - block.router_groups * (1 if block.num_experts // block.router_groups > 2 else 0)
    keep = max(keep - (1 if block.router_groups == 1 else 0), block.top_k)
    found = naee_search(weights, x, keep, max_candidates=100)
    assert check_groups(weights.rule, found.kept) is None and len(found.kept) == keep
    plan = assign_dropped(weights, found.kept, x)
    set_expert_weights(block, merged_weights(weights, plan, torch.ones(block.num_experts), x))
    assert block.num_experts == keep
    for name, tensor in [*block.experts.named_parameters(), *block.router.named_parameters()]:
        assert tensor.shape[0] == keep, name
    assert torch.isfinite(model_output(model, _ids())).all()
    assert ModelView(model).layer(block.index).widths()[block.spec.count_key] == keep


@pytest.mark.parametrize("family", FAMILIES)
def test_macs_count_every_projection_once_and_the_top_k_experts(family):
    """By hand: every Linear a token passes (attention with MLA's q_a / kv_a, dense MLPs, shared experts, the head,
    Llama 4's router, an nn.Linear), each other router's rows and the top-k experts of every routed layer, plus the
    attention products."""
    from slimkit.primitives.evaluate.counting import count_macs

    model = MOE_2026[family]()
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    routed = sum(
        (0 if isinstance(b.router, torch.nn.Linear) else b.router.weight.numel())
        + b.top_k * 3 * model.config.hidden_size * b.width
        for b in moe_blocks(model)
    )
    products = sum(2 * layer.num_heads * layer.head_dim for layer in ModelView(model).layers)
    assert count_macs(model, seq_len=1) == linears + routed + products
