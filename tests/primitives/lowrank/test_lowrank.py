"""Low-rank factorisation (LoRAP Eqs. 3–7), LowRankLinear and the attention parameter allocation."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.evaluate.counting import count_macs, params_by_part
from slimkit.primitives.lowrank import (
    LowRankLinear,
    activation_weighted_svd,
    allocate_attention,
    allocated_params,
    clamp_norms,
    dense_params,
    layer_ratio,
    lowrank_entries,
    lowrank_params,
    materialise_lowrank,
    max_useful_rank,
    member_target,
    rank_for_budget,
    truncated_svd,
    weighted_error,
)
from tests.tiny import model_output, tiny_llama

ATTENTION = ("q", "k", "v", "o")


def _skewed_norms(d_in: int) -> torch.Tensor:
    # A few outlier features, as in LLM activations: norms spanning ~3 orders of magnitude.
    return torch.exp(torch.randn(d_in, dtype=torch.float64) * 1.5).float()


# -- SVD / AWSVD ------------------------------------------------------------------------------------
def test_full_rank_truncated_svd_is_lossless():
    weight = torch.randn(40, 24)
    left, right = truncated_svd(weight, 24)
    assert left.shape == (40, 24) and right.shape == (24, 24)
    assert left.dtype == torch.float32 and right.dtype == torch.float32
    torch.testing.assert_close(left @ right, weight, atol=1e-5, rtol=0)


def test_truncated_svd_error_is_the_tail_of_the_spectrum():
    weight = torch.randn(30, 50, dtype=torch.float64)
    singular = torch.linalg.svdvals(weight)
    left, right = truncated_svd(weight, 7)
    assert right.shape == (7, 50)
    torch.testing.assert_close(right @ right.T, torch.eye(7, dtype=torch.float64))  # R = V_rᵀ
    assert weighted_error(weight, left, right) == pytest.approx(float(singular[7:].norm()), rel=1e-9)


def test_awsvd_minimises_the_activation_weighted_error():
    weight, norms, rank = torch.randn(64, 48), _skewed_norms(48), 8
    aw_left, aw_right = activation_weighted_svd(weight, norms, rank)
    svd_left, svd_right = truncated_svd(weight, rank)
    weighted_aw = weighted_error(weight, aw_left, aw_right, norms)
    weighted_svd = weighted_error(weight, svd_left, svd_right, norms)
    assert weighted_aw < 0.9 * weighted_svd  # Eq. 7's objective: AWSVD wins clearly
    # ... and attains the optimum: the tail of the spectrum of W D.
    tail = torch.linalg.svdvals(weight.double() * norms.double()[None, :])[rank:].norm()
    assert weighted_aw == pytest.approx(float(tail), rel=1e-4)
    # Plain SVD is the optimum of the unweighted error.
    assert weighted_error(weight, svd_left, svd_right) < weighted_error(weight, aw_left, aw_right)


@pytest.mark.parametrize("scale", [1.0, 3.7])
def test_awsvd_with_constant_norms_is_plain_svd(scale):
    weight = torch.randn(20, 32)
    aw_left, aw_right = activation_weighted_svd(weight, torch.full((32,), scale), 6)
    svd_left, svd_right = truncated_svd(weight, 6)
    torch.testing.assert_close(aw_left @ aw_right, svd_left @ svd_right, atol=1e-5, rtol=0)


def test_zero_norms_are_guarded():
    weight, norms = torch.randn(16, 12), _skewed_norms(12)
    norms[[0, 5]] = 0.0
    left, right = activation_weighted_svd(weight, norms, 4, eps=1e-6)
    assert torch.isfinite(left).all() and torch.isfinite(right).all()
    floor = clamp_norms(norms, eps=1e-6)
    assert floor[0] == pytest.approx(float(norms.max()) * 1e-6) and torch.equal(floor[1:5], norms[1:5])
    # All-zero norms (a layer that never saw input) fall back to D = I, i.e. plain SVD.
    left, right = activation_weighted_svd(weight, torch.zeros(12), 4)
    svd_left, svd_right = truncated_svd(weight, 4)
    torch.testing.assert_close(left @ right, svd_left @ svd_right, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="non-negative"):
        activation_weighted_svd(weight, -torch.ones(12), 4)
    with pytest.raises(ValueError, match="d_in=12"):
        activation_weighted_svd(weight, torch.ones(16), 4)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 12\]"):
        truncated_svd(weight, 13)


# -- LowRankLinear ----------------------------------------------------------------------------------
def test_lowrank_linear_computes_x_lr_plus_b():
    left, right, bias = torch.randn(10, 3), torch.randn(3, 7), torch.randn(10)
    module = LowRankLinear.from_factors(left, right, bias)
    assert (module.in_features, module.out_features, module.rank) == (7, 10, 3)
    assert not hasattr(module, "weight")
    x = torch.randn(2, 5, 7)
    expected = x @ (left @ right).T + bias
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
    dense = module.to_dense()
    assert isinstance(dense, nn.Linear)
    torch.testing.assert_close(dense(x), expected, atol=1e-5, rtol=1e-5)
    assert {k for k, _ in module.named_parameters()} == {"first.weight", "second.weight", "second.bias"}


def test_from_linear_at_full_rank_reproduces_the_linear():
    linear = nn.Linear(12, 9)
    x = torch.randn(4, 12)
    for norms in (None, _skewed_norms(12)):
        module = LowRankLinear.from_linear(linear, 9, norms)
        torch.testing.assert_close(module(x), linear(x), atol=1e-5, rtol=1e-5)


def test_manifest_entry_round_trip():
    module = LowRankLinear.from_linear(nn.Linear(16, 24, bias=True), 5)
    entry = json.loads(json.dumps(module.manifest_entry("model.layers.0.self_attn.q_proj")))
    assert entry == {
        "path": "model.layers.0.self_attn.q_proj",
        "kind": "low_rank",
        "rank": 5,
        "in_features": 16,
        "out_features": 24,
        "bias": True,
    }
    rebuilt = LowRankLinear.from_manifest_entry(entry)
    rebuilt.load_state_dict(module.state_dict(), strict=True)
    x = torch.randn(3, 16)
    assert torch.equal(rebuilt(x), module(x))
    with pytest.raises(ValueError, match="not a low-rank"):
        LowRankLinear.from_manifest_entry({**entry, "kind": "adapter"})


def _factor_attention(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    view = ModelView(model)
    for layer in view.layers:
        for role, rank in ranks.items():
            layer.set_linear(role, LowRankLinear.from_linear(layer.linear(role), rank))
    return model


def test_lowrank_model_views_counts_and_reloads(tmp_path):
    from safetensors.torch import load_file

    import slimkit

    dense = tiny_llama()
    before_params, before_macs = params_by_part(dense), count_macs(dense, seq_len=16)
    ranks = {"q": 4, "k": 3, "v": 5, "o": 6}  # q, o: 48 x 48; k, v: 16 x 48 (GQA)
    model = _factor_attention(copy.deepcopy(dense), ranks)
    view = ModelView(model)
    assert view.layer_widths() == ModelView(dense).layer_widths()

    saved = sum(
        dense_params(48, out) - lowrank_params(48, out, ranks[r])
        for r, out in zip(ATTENTION, (48, 16, 16, 48), strict=True)
    )
    assert params_by_part(model)["attention"] == before_params["attention"] - view.num_layers * saved
    assert count_macs(model, seq_len=16) == before_macs - view.num_layers * saved * 16

    entries = lowrank_entries(model)
    assert [e["path"] for e in entries[:4]] == [f"model.layers.0.self_attn.{r}_proj" for r in ATTENTION]
    ids = torch.randint(3, 200, (2, 9))
    expected = model_output(model, ids)

    fresh = tiny_llama()  # what a loader builds from the config, then materialises the pairs
    assert materialise_lowrank(fresh, [*entries, {"path": "x", "kind": "other"}]) == len(entries)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(model_output(fresh.eval(), ids), expected)

    # slimkit.save already passes the records through its manifest and writes the factor keys.
    folder = slimkit.save(model, None, tmp_path / "lowrank", manifest={"modules": entries})
    manifest = json.loads((folder / "slimkit_manifest.json").read_text())
    assert not (folder / "model.safetensors").exists()  # named so that stock loaders refuse the folder
    state = load_file(str(folder / "slimkit-model.safetensors"))
    assert "model.layers.1.self_attn.k_proj.first.weight" in state
    assert "model.layers.1.self_attn.k_proj.weight" not in state
    reloaded = tiny_llama()
    materialise_lowrank(reloaded, manifest["modules"])
    missing, unexpected = reloaded.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied head
    reloaded.tie_weights()
    torch.testing.assert_close(model_output(reloaded.eval(), ids), expected, atol=0, rtol=0)


def test_surgery_slices_the_factors_like_the_dense_product():
    from slimkit.primitives.groups import layer_group
    from slimkit.primitives.surgery import remove_units

    model = _factor_attention(tiny_llama(), {"q": 5, "o": 7})
    reference = copy.deepcopy(model)  # the same function with dense q, o
    for layer in ModelView(reference).layers:
        for role in ("q", "o"):
            layer.set_linear(role, layer.linear(role).to_dense())

    keep = torch.tensor([1, 2, 4, 5])  # two heads per KV group
    group = layer_group(reference, "attention_head", 1)
    members = []
    for member in group.members:
        sub, param = member_target(model.get_submodule(member.module), member.param, member.dim)
        members.append(
            dataclasses.replace(member, module=f"{member.module}.{sub}" if sub else member.module, param=param)
        )
    remove_units(model, dataclasses.replace(group, members=tuple(members)), keep)
    remove_units(reference, group, keep)

    q = ModelView(model).layer(1).linear("q")
    assert (q.rank, q.out_features, q.in_features) == (5, 32, 48)
    assert ModelView(model).layer_widths() == ModelView(reference).layer_widths()
    ids = torch.randint(3, 200, (2, 9))
    torch.testing.assert_close(model_output(model, ids), model_output(reference, ids), atol=1e-5, rtol=1e-5)


def test_lora_targets_the_inner_linears_and_merges_into_them():
    from peft import LoraConfig, get_peft_model

    model = _factor_attention(tiny_llama(), {"q": 4, "o": 6})
    config = LoraConfig(r=2, target_modules=["first", "second", "up_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q.first).__name__ == "Linear" and hasattr(q.first, "lora_A")  # peft's LoRA Linear
    ids = torch.randint(3, 200, (1, 7))
    adapted = model_output(peft_model, ids)
    merged = peft_model.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj
    assert isinstance(q, LowRankLinear) and q.rank == 4 and type(q.first) is nn.Linear
    torch.testing.assert_close(model_output(merged, ids), adapted, atol=1e-5, rtol=1e-5)


def test_member_target():
    module = LowRankLinear(8, 6, 2)
    assert member_target(module, "weight", 0) == ("second", "weight")
    assert member_target(module, "bias", 0) == ("second", "bias")
    assert member_target(module, "weight", 1) == ("first", "weight")
    assert member_target(nn.Linear(8, 6), "weight", 1) == ("", "weight")


# -- allocation -------------------------------------------------------------------------------------
def test_rank_arithmetic():
    assert rank_for_budget(576, 192, 76_800) == 100  # 76_800 / (576 + 192)
    assert rank_for_budget(576, 192, 76_799) == 99
    assert rank_for_budget(576, 192, 10) == 1
    assert lowrank_params(576, 192, 100) == 76_800
    assert dense_params(576, 192) == 110_592
    assert max_useful_rank(576, 576) == 287  # break-even 576·576 / 1152 = 288
    assert max_useful_rank(576, 192) == 143  # break-even 110_592 / 768 = 144
    for d_in, d_out in ((576, 576), (576, 192), (4096, 11008), (7, 5)):
        r = max_useful_rank(d_in, d_out)
        assert lowrank_params(d_in, d_out, r) < dense_params(d_in, d_out) <= lowrank_params(d_in, d_out, r + 1)
    # With a wall-time margin: r·(d_in + d_out) < 0.75·d_in·d_out.
    assert max_useful_rank(576, 576, 0.75) == 215  # 0.75 x 288 = 216
    assert max_useful_rank(576, 192, 0.75) == 107  # 0.75 x 144 = 108
    assert max_useful_rank(576, 192, 0.7) == 100  # 0.7 x 144 = 100.8


def _square(d: int) -> dict[str, tuple[int, int]]:
    return dict.fromkeys(ATTENTION, (d, d))


GQA = {"q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576)}  # (d_out, d_in)


def test_allocation_square_mha_is_one_to_three():
    # 4 x 4096 weights, keep half (8192): QK gets 2048 (1024 each), VO 6144 (3072 each); r = p / 128.
    assert allocate_attention(_square(64), 8192) == {"q": 8, "k": 8, "v": 24, "o": 24}
    assert allocate_attention(_square(64), 8192, qk_share=0.5) == {"q": 16, "k": 16, "v": 16, "o": 16}


def test_allocation_under_gqa_splits_by_parameter_counts():
    # Dense: q = o = 331_776, k = v = 110_592; each group 442_368. Keep half: QK 110_592, VO 331_776.
    ranks = allocate_attention(GQA, 442_368)
    # QK: q gets 3/4 (82_944 -> 82_944 // 1152 = 72), k 1/4 (27_648 -> // 768 = 36): both keep 25%.
    # VO: v 82_944 // 768 = 108, o 248_832 // 1152 = 216: both keep 75%.
    assert ranks == {"q": 72, "k": 36, "v": 108, "o": 216}
    assert allocated_params(GQA, ranks) == 442_368


def test_allocation_special_case_vo_dense_surplus_to_qk():
    # The paper's 20% example (Appendix C): VO's share (0.6 of 16_384) exceeds its dense 8192, so
    # W_v, W_o stay dense and W_q, W_k get the rest, 60% of their parameters: 2457 -> r = 19.
    assert allocate_attention(_square(64), 13_107) == {"q": 19, "k": 19, "v": None, "o": None}


def test_allocation_special_case_qk_dense_surplus_to_vo():
    # 3:1 towards QK, keep 75% (663_552): QK's share 497_664 >= its dense 442_368, so q, k stay dense
    # and VO gets 663_552 - 442_368 = 221_184 (half of VO): v 55_296 // 768 = 72, o 165_888 // 1152 = 144.
    assert allocate_attention(GQA, 663_552, qk_share=0.75) == {"q": None, "k": None, "v": 72, "o": 144}


def test_allocation_speed_margin_moves_the_excess():
    # Keep 62.5% (552_960): QK 138_240, VO 414_720 (94% of VO, not dense). Without a margin:
    assert allocate_attention(GQA, 552_960) == {"q": 90, "k": 45, "v": 135, "o": 270}
    # With mac_fraction 0.75, VO holds at most v 107 x 768 + o 215 x 1152 = 329_856; the excess
    # 84_864 goes to QK (223_104): q 167_328 // 1152 = 145, k 55_776 // 768 = 72; VO split by
    # counts: v 82_464 // 768 = 107, o 247_392 // 1152 = 214.
    assert allocate_attention(GQA, 552_960, mac_fraction=0.75) == {"q": 145, "k": 72, "v": 107, "o": 214}


def test_allocation_never_exceeds_budget_or_useful_rank():
    total = sum(dense_params(s[1], s[0]) for s in GQA.values())
    assert allocate_attention(GQA, total) == dict.fromkeys(ATTENTION)
    for budget in range(4 * 1920, total, 9_973):
        for share in (0.25, 0.5, 0.75):
            for fraction in (1.0, 0.75):
                ranks = allocate_attention(GQA, budget, qk_share=share, mac_fraction=fraction)
                assert allocated_params(GQA, ranks) <= budget
                for role, rank in ranks.items():
                    d_out, d_in = GQA[role]
                    assert rank is None or 1 <= rank <= max_useful_rank(d_in, d_out, fraction)
    with pytest.raises(ValueError, match="roles q, k, v, o"):
        allocate_attention({"q": (4, 4)}, 10)
    with pytest.raises(ValueError, match="qk_share"):
        allocate_attention(GQA, 10, qk_share=1.0)


def test_layer_ratio():
    # Ratio_l = Param_total x Ratio_s / (layers x Param_layer) = 1000 x 0.2 / (4 x 100)
    assert layer_ratio(1000, 0.2, 4, 100) == pytest.approx(0.5)
    assert layer_ratio(1000, 0.0, 4, 100) == 0.0
    with pytest.raises(ValueError, match="compressible layer parameters"):
        layer_ratio(1000, 0.4, 4, 100)
