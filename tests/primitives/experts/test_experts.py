"""Expert units: surgery, kept-set scoring (router statistics, NAEE) and merging, on tiny MoE models of each family."""

import itertools

import pytest
import torch

from slimkit.primitives.arch.moe import moe_blocks
from slimkit.primitives.calibration.routing import collect_routing
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.experts import ExpertWeights, keep_experts, kept_weights, routed_output
from slimkit.primitives.experts.merge import assign_dropped, merged_weights, set_expert_weights
from slimkit.primitives.experts.scores import (
    KeptSetLoss,
    allocate_removals,
    dropped_share_curve,
    keep_top,
    naee_search,
    router_scores,
)
from tests.tiny import MOE_FAMILIES, model_output


def _renormalising(model):
    # Removing a router row changes the softmax's normaliser; only renormalised top-k weights ignore it.
    for block in moe_blocks(model):
        block.router.norm_topk_prob = True
    model.config.norm_topk_prob = True
    return model


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_removing_experts_the_router_never_selects_leaves_outputs_unchanged(family):
    torch.manual_seed(1)
    model = _renormalising(MOE_FAMILIES[family](experts=6, top_k=2))
    ids = torch.randint(3, 300, (1, 2))  # 2 tokens x top-2: at least 2 of 6 experts unused in each layer
    before = model_output(model, ids)
    stats = collect_routing(model, [ids])
    for block in moe_blocks(model):
        used = [e for e in range(block.num_experts) if stats[block.index].counts[e] > 0]
        assert len(used) < block.num_experts
        keep_experts(block, used + [e for e in range(block.num_experts) if e not in used][: max(0, 2 - len(used))])
        assert block.num_experts == block.experts.num_experts == block.router.num_experts < 6
    torch.testing.assert_close(model_output(model, ids), before, rtol=0, atol=1e-5)


def test_keep_experts_refuses_fewer_than_top_k_and_bad_indices():
    block = moe_blocks(MOE_FAMILIES["mixtral"](experts=4, top_k=2))[0]
    with pytest.raises(SlimkitError, match="fewer than the 2 the router picks"):
        keep_experts(block, [3])
    with pytest.raises(SlimkitError, match="distinct indices in 0-3"):
        keep_experts(block, [1, 1, 5])
    assert block.num_experts == 4


def test_kept_weights_slices_rows_by_hand():
    router = torch.arange(8.0).reshape(4, 2)
    gate_up = torch.arange(4 * 6 * 2.0).reshape(4, 6, 2)
    down = torch.arange(4 * 2 * 3.0).reshape(4, 2, 3)
    r, g, d = kept_weights(router, gate_up, down, [0, 2])
    assert r.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    assert torch.equal(g, gate_up[[0, 2]]) and torch.equal(d, down[[0, 2]])


def test_router_scores_and_keep_top():
    model = MOE_FAMILIES["qwen3_moe"]()
    stats = collect_routing(model, [torch.randint(3, 300, (2, 8))])[0]
    freq = router_scores(stats, "frequency")
    assert float(freq.sum()) == pytest.approx(2.0)  # top-2: each token picks two experts
    assert keep_top(torch.tensor([0.1, 0.5, 0.5, 0.0]), 2) == [1, 2]
    assert dropped_share_curve(torch.tensor([1.0, 3.0])) == [0.0, 0.25, 1.0]


def test_naee_exhaustive_is_the_best_set_and_greedy_traces_the_curve():
    torch.manual_seed(0)
    block = moe_blocks(MOE_FAMILIES["qwen3_moe"](experts=6, top_k=2))[0]
    weights = ExpertWeights.of(block)
    x = torch.randn(40, 32)
    loss = KeptSetLoss(weights, x)
    by_hand = min((loss(list(s)), list(s)) for s in itertools.combinations(range(6), 4))
    found = naee_search(weights, x, 4, max_candidates=100)
    assert found.exhaustive and found.kept == by_hand[1] and found.candidates == 15
    assert found.loss == pytest.approx(by_hand[0])
    # the loss is the relative error of the routed output with only the kept experts routable
    mask = torch.zeros(6, dtype=torch.bool)
    mask[found.kept] = True
    dense, kept = routed_output(weights, x), routed_output(weights, x, mask)
    assert found.loss == pytest.approx(float((dense - kept).pow(2).sum() / dense.pow(2).sum()), rel=1e-4)
    greedy = naee_search(weights, x, 4, max_candidates=1)
    assert not greedy.exhaustive and len(greedy.kept) == 4
    assert greedy.candidates == 6 + 5 and greedy.curve[0] == 0.0 and len(greedy.curve) == 3
    assert greedy.loss >= found.loss - 1e-12


def test_allocate_removals_takes_the_cheapest_next_removal():
    curves = {0: [0.0, 0.1, 0.5, 2.0], 1: [0.0, 0.2, 0.3, 0.4]}
    assert allocate_removals(curves, 3, {0: 3, 1: 3}) == {0: 1, 1: 2}
    assert allocate_removals(curves, 3, {0: 3, 1: 1}) == {0: 2, 1: 1}
    with pytest.raises(ValueError):
        allocate_removals(curves, 5, {0: 2, 1: 2})


def test_merging_a_duplicated_expert_into_its_twin_is_exact():
    torch.manual_seed(0)
    model = MOE_FAMILIES["qwen3_moe"](experts=5, top_k=2)
    block = moe_blocks(model)[0]
    u = torch.nn.functional.normalize(torch.randn(32), dim=0)
    x = 3.0 * u + 0.3 * torch.randn(64, 32)  # every token leans on u
    with torch.no_grad():
        block.experts.gate_up_proj[4] = block.experts.gate_up_proj[1]  # expert 4: a copy of expert 1
        block.experts.down_proj[4] = block.experts.down_proj[1]
        block.router.weight[4] = -20.0 * u  # ... that the router never picks on these tokens
    weights = ExpertWeights.of(block)
    plan = assign_dropped(weights, [0, 1, 2, 3], x)
    assert plan.clusters[1] == [1, 4]  # the twin: identical outputs
    mass = torch.tensor([3.0, 2.0, 1.0, 1.0, 5.0])
    merged = merged_weights(weights, plan, mass, x, damp=0.0)
    assert torch.equal(merged.gate_up[1], weights.gate_up[1]) and torch.equal(merged.down[1], weights.down[1])
    dense = routed_output(weights, x)
    torch.testing.assert_close(routed_output(merged, x), dense, rtol=0, atol=1e-5)
    set_expert_weights(block, merged)
    assert block.num_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(block.module(x[None])[0], dense, rtol=0, atol=1e-5)
