"""Groups, scorers, selection rules and plans on hand-checkable cases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimkit.primitives.calibration.gradients import GradientStats, accumulate_gradients
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.groups import Group, Member, build_groups, layer_group
from slimkit.primitives.importance import SCORERS, reduce_units
from slimkit.primitives.select import (
    eligible_layers,
    global_keep,
    keep_count,
    keep_top,
    keep_top_per_block,
    protect_lowest,
)
from slimkit.primitives.select.plan import SelectionRules, plan, solve_fraction


class TwoLayerMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(2, 3, bias=False)
        self.down = nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(torch.tensor([[1.0, -2.0], [3.0, 4.0], [0.0, 1.0]]))
            self.down.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]]))


def mlp_group() -> Group:
    units = torch.arange(3)[:, None]
    return Group("mlp_channel", 0, (Member("up", "weight", 0, units), Member("down", "weight", 1, units)))


def test_reduce_units_hand_case():
    v = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert reduce_units(v, "l1").tolist() == [3.0, 7.0]
    assert reduce_units(v, "l2").tolist() == pytest.approx([5**0.5, 5.0])
    assert reduce_units(v, "linf").tolist() == [2.0, 4.0]
    assert reduce_units(v, "mean").tolist() == [1.5, 3.5]


def test_magnitude_and_activation_hand_case():
    model, group = TwoLayerMLP(), mlp_group()
    assert SCORERS["magnitude"].fn(group, model, {}, aggregation="l1").tolist() == [4.0, 8.0, 4.0]
    norms = {"up": torch.tensor([1.0, 2.0]), "down": torch.tensor([3.0, 1.0, 2.0])}
    got = SCORERS["activation"].fn(group, model, {"input_norms": norms}, aggregation="l1")
    assert got.tolist() == [8.0, 12.0, 8.0]


def test_taylor_hand_case():
    model, group = TwoLayerMLP(), mlp_group()
    ones = {id(p): torch.ones_like(p) for p in model.parameters()}
    stats = {"gradients": GradientStats(ones, ones, 1)}
    assert SCORERS["taylor"].fn(group, model, stats, order="first", level="vector").tolist() == [2.0, 8.0, 4.0]
    assert SCORERS["taylor"].fn(group, model, stats, order="first", level="element").tolist() == [4.0, 8.0, 4.0]
    # 0.5 * h * w^2 with h = 1: unit 0 = 0.5 * (1 + 4) + 0.5 * (1 + 0)
    assert SCORERS["taylor"].fn(group, model, stats, order="second", level="element").tolist() == [3.0, 13.0, 3.0]


def test_random_scorer_is_seeded():
    model, group = TwoLayerMLP(), mlp_group()
    a = SCORERS["random"].fn(group, model, {}, generator=torch.Generator().manual_seed(3))
    b = SCORERS["random"].fn(group, model, {}, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (3,)


def test_accumulated_gradients_match_manual_backward(llama):
    batches = [torch.randint(3, 200, (2, 8)), torch.randint(3, 200, (2, 8))]
    stats = accumulate_gradients(llama, batches)
    weight = llama.model.layers[1].mlp.up_proj.weight
    expected = torch.zeros_like(weight)
    expected_sq = torch.zeros_like(weight)
    for batch in batches:
        llama.zero_grad()
        llama(batch, labels=batch).loss.backward()
        expected += weight.grad
        expected_sq += weight.grad**2
    grad, grad_sq = stats.of(weight)
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(grad_sq, expected_sq)
    assert stats.batches == 2


def test_group_kinds_on_gqa_llama(llama):
    mlp = layer_group(llama, "mlp_channel", 0)
    assert [(m.module.split(".")[-1], m.dim) for m in mlp.members] == [
        ("gate_proj", 0),
        ("up_proj", 0),
        ("down_proj", 1),
    ]
    kv = layer_group(llama, "kv_group", 0)  # 6 heads of 8 over 2 KV heads: 3 query heads per group
    q, k = kv.members[0], kv.members[1]
    assert q.indices[1].tolist() == list(range(24, 48)) and k.indices[1].tolist() == list(range(8, 16))
    heads = layer_group(llama, "attention_head", 2)
    assert (
        heads.size == 6
        and heads.extra["kv_groups"] == 2
        and heads.members[0].indices[5].tolist() == list(range(40, 48))
    )
    qk = layer_group(llama, "qk_dim", 0)  # RoPE pairs j with j + 4 inside every head
    assert qk.size == 4 and qk.members[0].indices[0].tolist()[:4] == [0, 4, 8, 12]
    vo = layer_group(llama, "vo_dim", 0)
    assert vo.members[0].indices[2].tolist() == [2, 10] and vo.members[1].indices[2].tolist()[:2] == [2, 10]
    hidden = build_groups(llama, "hidden_feature")[0]
    assert hidden.layer is None and hidden.size == 48
    assert len(hidden.members) == 1 + 3 * (7 + 2) + 1  # embedding, per layer 7 linears + 2 norms, final norm


def test_opt_groups_include_biases_and_position_embeddings(opt):
    mlp = layer_group(opt, "mlp_channel", 0)
    assert [(m.module.split(".")[-1], m.param) for m in mlp.members] == [
        ("fc1", "weight"),
        ("fc1", "bias"),
        ("fc2", "weight"),
    ]
    hidden = build_groups(opt, "hidden_feature")[0]
    assert any(m.module.endswith("embed_positions") for m in hidden.members)


def test_selection_rules():
    assert keep_count(1536, 0.2) == 1229 and keep_count(1536, 0.2, multiple=64) == 1216
    assert keep_count(10, 0.99) == 1
    assert keep_top(torch.tensor([0.5, 3.0, 1.0, 3.0]), 2).tolist() == [1, 3]
    assert keep_top_per_block(torch.tensor([1.0, 9.0, 5.0, 7.0, 2.0, 3.0]), 2, 4).tolist() == [1, 2, 3, 5]
    assert protect_lowest(torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0]), 3, 0.2).tolist() == [0, 1, 2]
    assert global_keep([torch.tensor([1.0, 5.0, 6.0]), torch.tensor([2.0, 3.0, 4.0])], 0.5) == [2, 1]
    assert global_keep([torch.tensor([1.0, 2.0]), torch.tensor([9.0, 9.0])], 0.5, minimum=1) == [1, 1]
    assert eligible_layers(10, 2, 1) == list(range(2, 9))
    with pytest.raises(SlimkitError, match="leave none of 4 layers"):
        eligible_layers(4, 2, 2)


def test_solve_fraction_meets_a_model_level_target(llama):
    groups = build_groups(llama, "mlp_channel")
    scores = [torch.rand(g.size) for g in groups]
    before = params_by_part(llama)
    wanted = round(0.25 * before["mlp"])
    fraction = solve_fraction(llama, groups, scores, SelectionRules(), "mlp", wanted)
    assert fraction == pytest.approx(0.25, abs=1 / 64)
    keeps = plan(groups, scores, fraction, SelectionRules())
    assert [k.numel() for k in keeps] == [48, 48, 48]


def test_plan_fails_before_changes_with_layer_and_numbers(llama):
    heads = build_groups(llama, "attention_head")
    scores = [torch.rand(g.size) for g in heads]
    with pytest.raises(SlimkitError, match=r"layer 0 attention_head: removing 90.0% of 6 units would leave 0"):
        plan(heads, scores, 0.9, SelectionRules())
    kv = build_groups(llama, "kv_group")
    with pytest.raises(SlimkitError, match="layer 0 kv_group: cannot round 2 units to a multiple of 4"):
        plan(kv, [torch.rand(2)] * 3, 0.2, SelectionRules(round_to={"kv_group": 4}))
    with pytest.raises(SlimkitError, match="can remove at most"):
        solve_fraction(llama, kv, [torch.rand(2)] * 3, SelectionRules(), "total", 10**9)
