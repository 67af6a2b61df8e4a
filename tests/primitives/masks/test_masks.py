"""SP3 masks: hard-concrete gates, the Eq. 30 count, the Lagrangian (Eq. 14), binarisation, schedules, hooks."""

from __future__ import annotations

import copy

import pytest
import torch

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import layer_group
from slimkit.primitives.masks.gates import (
    HardConcrete,
    expected_value,
    hard_concrete_deterministic,
    hard_concrete_sample,
    keep_probability,
    one_probability,
)
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MASK_FIELDS, MaskSet, MaskShape, MaskValues
from slimkit.primitives.masks.schedule import MaskSchedule
from slimkit.primitives.masks.sparsity import (
    Lagrangian,
    binarize,
    couple_intermediate,
    dense_size,
    expected_size,
    expected_sparsity,
    lagrangian_optimizer,
    negate_gradients,
)
from slimkit.primitives.surgery.units import remove_units
from tests.tiny import tiny_bert, tiny_llama, tiny_opt

# -- hard-concrete gates --------------------------------------------------------------------------


@pytest.mark.parametrize("log_alpha", [-3.0, -1.0, 0.0, 1.5, 4.0])
def test_hard_concrete_sampling_matches_analytic_statistics(log_alpha):
    g = torch.Generator().manual_seed(0)
    n = 200_000
    la = torch.full((n,), log_alpha, dtype=torch.float64)
    z = hard_concrete_sample(la, torch.rand(n, generator=g, dtype=torch.float64))
    one = torch.tensor(log_alpha, dtype=torch.float64)
    assert float((z > 0).double().mean()) == pytest.approx(float(keep_probability(one)), abs=0.005)
    assert float((z == 1).double().mean()) == pytest.approx(float(one_probability(one)), abs=0.005)
    assert float(z.mean()) == pytest.approx(float(expected_value(one)), abs=0.005)
    # E[z] lies between the mass at 1 and the mass away from 0
    assert float(one_probability(one)) <= float(expected_value(one)) <= float(keep_probability(one))


def test_deterministic_values_and_samples_lie_in_unit_interval():
    la = torch.linspace(-20, 20, 401)
    det = hard_concrete_deterministic(la)
    assert float(det.min()) == 0.0 and float(det.max()) == 1.0
    assert bool((det[1:] >= det[:-1]).all())  # monotone in log_alpha
    z = hard_concrete_sample(la.repeat(50))
    assert float(z.min()) >= 0.0 and float(z.max()) <= 1.0
    # log_alpha = 0: sigma(0) * 1.2 - 0.1 = 0.5 and P(z != 0) = sigma(-2/3 log(1/11))
    zero = torch.zeros(())
    assert float(hard_concrete_deterministic(zero)) == pytest.approx(0.5)
    assert float(keep_probability(zero)) == pytest.approx(float(torch.sigmoid(torch.tensor(2 / 3 * 2.397895))), 1e-5)


def test_hard_concrete_module_gradients_and_modes():
    gate = HardConcrete(16, generator=torch.Generator().manual_seed(0))
    assert gate.log_alpha.abs().max() < 0.1  # CoFi's init: drop rate 0.5 -> log_alpha ~ N(0, 0.01)
    gate.train()
    gate().sum().backward()
    assert gate.log_alpha.grad is not None and gate.log_alpha.grad.abs().sum() > 0
    gate.eval()
    assert torch.equal(gate(), hard_concrete_deterministic(gate.log_alpha))
    gate.keep_prob().sum().backward()


# -- mask sets ---------------------------------------------------------------------------------------


def test_mask_set_fields_levels_and_activation():
    shape = MaskShape.from_view(ModelView(tiny_bert()))
    assert (shape.hidden, shape.heads, shape.head_dim, shape.ffn) == (32, (4, 4), 8, (48, 48))
    masks = MaskSet(shape, seed=0)
    assert set(masks.field_names()) == set(MASK_FIELDS)
    values = masks.keep_probs()
    values.check(shape)
    assert values.q[0].shape == (4, 8) and values.mha[1].shape == () and values.f[0].shape == (48,)
    masks.set_active(["dimension"])
    values = masks.sample()
    assert values.head is None and values.mha is None and values.f is not None
    assert not any(p.requires_grad for p in masks.level_parameters("head"))
    assert all(p.requires_grad for p in masks.level_parameters("dimension"))
    # Table 11 variants and the CoFi hidden mask
    assert MaskSet(shape, head=False, layer=False).levels == {"dimension"}
    shared = MaskSet(shape, hidden="shared", intermediate=False)
    v = shared.deterministic()
    assert v.mha_in[0] is v.ffn_out[1] and v.q is None
    with pytest.raises(SlimkitError, match="RoPE"):
        MaskSet.from_view(ModelView(tiny_llama()))
    assert MaskSet.from_view(ModelView(tiny_llama()), intermediate=False).levels == {"dimension", "head", "layer"}


# -- the count (Eq. 30) ----------------------------------------------------------------------------------


def random_binary(shape: MaskShape, names, seed: int, p: float = 0.6) -> MaskValues:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        out[name] = [(torch.rand(shape.field_shape(name, i), generator=g) < p).float() for i in range(shape.num_layers)]
    for name in ("mha", "ffn"):  # layer masks: mostly kept, so the rest of the count matters
        if name in out:
            out[name] = [torch.tensor(float(torch.rand((), generator=g) < 0.8)) for _ in range(shape.num_layers)]
    return MaskValues(**out)


def _nz(values, layer: int, full: int) -> torch.Tensor:
    return torch.arange(full) if values is None else values[layer].bool().flatten().nonzero().flatten()


def pruned_count(model, masks: MaskValues, include_bias: bool, residual: bool = True) -> int:
    """Slice every Linear by its own 0/1 masks (``Pr`` of Eqs. 15–16) and count what is left."""
    view = ModelView(model)
    total = 0

    def take(linear, rows, cols):
        nonlocal total
        total += linear.weight[rows][:, cols].numel()
        if include_bias and linear.bias is not None:
            total += linear.bias[rows].numel()

    for i, layer in enumerate(view.layers):
        h, kv, dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
        d = view.hidden_size
        head = torch.ones(h) if masks.head is None else masks.head[i]
        kv_head = head.view(kv, h // kv).amax(-1)

        def rows(heads: torch.Tensor, dims, i: int = i, dh: int = dh) -> torch.Tensor:
            keep = heads[:, None].expand(-1, dh).clone()
            if dims is not None:
                keep = keep * dims[i]
            return keep.flatten().bool().nonzero().flatten()

        a, c = _nz(masks.mha_in, i, d), _nz(masks.mha_out, i, d)
        if masks.mha is None or masks.mha[i] > 0:
            take(layer.linear("q"), rows(head, masks.q), a)
            take(layer.linear("k"), rows(kv_head, masks.k), a)
            take(layer.linear("v"), rows(kv_head, masks.v), a)
            take(layer.linear("o"), c, rows(head, masks.o))
        a2, c2 = _nz(masks.ffn_in, i, d), _nz(masks.ffn_out, i, d)
        f = _nz(masks.f, i, layer.mlp_width)
        if masks.ffn is None or masks.ffn[i] > 0:
            for role in layer.mlp_input_roles:
                take(layer.linear(role), f, a2)
            take(layer.linear("down"), c2, f)
        if residual:  # W_R = Pr(diag(z_in) P_in P_out diag(z_out)): one dense matrix per block (Eq. 18)
            total += torch.empty(len(c), len(a)).numel() + torch.empty(len(c2), len(a2)).numel()
    return total


MODELS = {"bert": tiny_bert, "opt": tiny_opt, "llama": tiny_llama}


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("include_bias", [False, True])
def test_binary_count_equals_pruned_model(arch, include_bias):
    model = MODELS[arch]()
    view = ModelView(model)
    shape = MaskShape.from_view(view)
    names = [n for n in MASK_FIELDS if not (shape.rope and n in ("q", "k", "v", "o"))]
    # the dense count is the model's attention + MLP Linears
    linears = sum(
        layer.linear(r).weight.numel()
        + (layer.linear(r).bias.numel() if include_bias and layer.linear(r).bias is not None else 0)
        for layer in view.layers
        for r in layer.roles
    )
    assert dense_size(shape, include_bias=include_bias) == linears
    for seed in range(4):
        masks = random_binary(shape, names, seed)
        for coupled in (masks, couple_intermediate(masks)):
            count = expected_size(coupled, shape, include_bias=include_bias)
            assert float(count) == pruned_count(model, coupled, include_bias)
            no_residual = expected_size(coupled, shape, include_bias=include_bias, residual="none")
            assert float(no_residual) == pruned_count(model, coupled, include_bias, residual=False)


def test_count_by_hand_and_residual_readings():
    shape = MaskShape.from_view(ModelView(tiny_bert()))  # d=32, H=4, d_h=8, d_f=48, 2 layers
    d, ff = 32, 48
    assert dense_size(shape) == 2 * (4 * d * d + 2 * d * ff)
    ones = MaskValues.ones(shape, ["mha_in", "mha_out"])
    m = MaskValues(
        mha_in=[torch.cat([torch.ones(10), torch.zeros(22)]), torch.ones(d)],
        mha_out=[torch.cat([torch.ones(6), torch.zeros(26)]), torch.ones(d)],
        f=[torch.cat([torch.ones(5), torch.zeros(43)]), torch.ones(ff)],
        head=[torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4)],
    )
    layer0 = 10 * (3 * 2 * 8) + 6 * (2 * 8) + 5 * (d + d)
    layer1 = 4 * d * d + 2 * d * ff
    residual = 10 * 6 + d * d  # the MHA blocks' W_R; the FFN blocks have no hidden masks, hence no W_R
    assert float(expected_size(m, shape)) == layer0 + layer1 + residual
    assert float(expected_size(m, shape, residual="none")) == layer0 + layer1
    # Eq. 30 as printed: the residual terms sum z_out^k z_in^k over one index k
    assert float(expected_size(m, shape, residual="diagonal")) == layer0 + layer1 + 6 + d
    assert float(expected_size(m, shape, residual="dense", residual_blocks=[True, False, False, False])) == (
        layer0 + layer1 + 60
    )
    # full masks with residual matrices: more weights than the dense model, so sparsity < 0
    assert float(expected_sparsity(ones, shape)) == pytest.approx(-2 * d * d / dense_size(shape))
    assert float(expected_sparsity(MaskValues(), shape)) == 0.0


def test_expected_count_is_the_mean_of_binary_counts():
    shape = MaskShape.from_view(ModelView(tiny_opt()))
    masks = MaskSet(shape, seed=0, init_std=1.5)
    probs = masks.keep_probs().map(lambda t: t.detach())
    g = torch.Generator().manual_seed(1)
    draws = [
        float(expected_size(probs.map(lambda p: (torch.rand(p.shape, generator=g) < p).float()), shape))
        for _ in range(400)
    ]
    expected = float(expected_size(probs, shape))
    mean = sum(draws) / len(draws)
    spread = (sum((x - mean) ** 2 for x in draws) / len(draws)) ** 0.5
    assert abs(mean - expected) < 4 * spread / len(draws) ** 0.5


# -- Lagrangian (Eq. 14) ---------------------------------------------------------------------------------


def test_lagrangian_gradients_ascend_the_multipliers():
    for s_value, target in ((0.2, 0.5), (0.7, 0.5)):
        lag = Lagrangian()
        s_hat = torch.tensor(s_value, dtype=torch.float64)
        lag(s_hat, target).backward()
        assert float(lag.lambda_1.grad) == pytest.approx(s_value - target)
        assert float(lag.lambda_2.grad) == pytest.approx((s_value - target) ** 2)
        opt = lagrangian_optimizer(lag, lr=0.1)
        opt.step()
        # ascent: lambda_1 follows the sign of the gap, lambda_2 grows
        assert (float(lag.lambda_1.detach()) > 0) == (s_value > target) and float(lag.lambda_2.detach()) > 0
        # negated gradients + a minimising optimiser do the same step
        other = Lagrangian()
        negate_gradients(other)
        other(s_hat, target).backward()
        torch.optim.AdamW(other.parameters(), lr=0.1, weight_decay=0.0).step()
        assert torch.allclose(other.lambda_1, lag.lambda_1) and torch.allclose(other.lambda_2, lag.lambda_2)


@pytest.mark.slow
def test_lagrangian_pushes_expected_sparsity_toward_target():
    shape = MaskShape.from_view(ModelView(tiny_bert()))
    for target in (0.6, -0.2):  # start is about -0.1 (all-ones masks: -0.29): below, then above t
        masks = MaskSet(shape, seed=0, init_drop=0.2)
        lag = Lagrangian()
        mask_opt = torch.optim.Adam(masks.parameters(), lr=0.05)
        lag_opt = lagrangian_optimizer(lag, lr=0.05)
        start = float(expected_sparsity(masks.keep_probs(), shape).detach())
        for step in range(300):
            s_hat = expected_sparsity(masks.keep_probs(), shape)
            mask_opt.zero_grad()
            lag_opt.zero_grad()
            lag(s_hat, target).backward()
            if step == 5:  # after a few ascent steps lambda_1 has the sign of the gap ...
                assert (float(lag.lambda_1.detach()) < 0) == (start < target)
                # ... and the masks' gradient points so that a descent step moves s_hat toward t
                before = float(s_hat.detach())
                with torch.no_grad():
                    for p in masks.parameters():
                        p -= 0.1 * p.grad
                after = float(expected_sparsity(masks.keep_probs(), shape).detach())
                assert (after > before) == (start < target)
            mask_opt.step()
            lag_opt.step()
        end = float(expected_sparsity(masks.keep_probs(), shape).detach())
        assert abs(end - target) < 0.25 * abs(start - target)


# -- binarisation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [0.3, 0.6, 0.9])
def test_binarize_meets_target_with_the_lowest_threshold(target):
    shape = MaskShape.from_view(ModelView(tiny_bert()))
    masks = MaskSet(shape, seed=0, init_std=2.0)
    scores = masks.scores()
    result = binarize(scores, shape, target)
    assert result.sparsity >= target
    assert result.size == pruned_count(tiny_bert(), result.masks, include_bias=False)
    # every kept entry scores >= threshold; the rest are 0 (before QK/VO coupling)
    plain = binarize(scores, shape, target, couple=False)
    for name, values in scores.items():
        for t, b in zip(values, getattr(plain.masks, name), strict=True):
            assert torch.equal(b.bool(), t >= plain.threshold)
    # the next lower distinct score would keep too much
    flat = torch.cat([t.flatten() for _, v in scores.items() for t in v]).double()
    lower = flat[flat < result.threshold]
    if lower.numel():
        next_tau = float(lower.max())
        keep = couple_intermediate(scores.map(lambda t: (t.double() >= next_tau).float()))
        assert float(expected_sparsity(keep, shape)) < target
    # q and k (v and o) keep the same dimensions after coupling
    assert all(torch.equal(q, k) for q, k in zip(result.masks.q, result.masks.k, strict=True))


def test_binarize_only_touches_active_levels_and_rejects_unreachable_targets():
    shape = MaskShape.from_view(ModelView(tiny_opt()))
    masks = MaskSet(shape, seed=0, init_std=2.0)
    masks.set_active(["dimension"])
    result = binarize(masks.scores(), shape, 0.4)
    assert result.masks.head is None and result.masks.mha is None
    # the final masks: deterministic values where kept, 0 elsewhere (inactive levels stay absent)
    final = masks.deterministic().times(result.masks)
    assert final.head is None
    det = masks.deterministic()
    assert all(torch.equal(x, y * b) for x, y, b in zip(final.f, det.f, result.masks.f, strict=True))
    only_ffn = MaskValues(f=masks.scores().f)
    with pytest.raises(SlimkitError, match="out of reach"):
        binarize(only_ffn, shape, 0.9, residual="none")


def test_selection_reaches_the_target_without_the_overshoot_of_a_block_gate():
    """A block gate crossing the threshold removes a whole block; the selection keeps it, removes smaller units."""
    shape = MaskShape.from_view(ModelView(tiny_bert()))
    masks = MaskSet(shape, seed=0, init_std=2.0)
    scores = masks.scores()
    scores.mha = [torch.full_like(t, -10.0) for t in scores.mha]  # both attention blocks score lowest
    target, tolerance = 0.2, 0.01
    plain = binarize(scores, shape, target)
    selected = binarize(scores, shape, target, tolerance=tolerance)
    assert plain.sparsity > target + 0.05  # the threshold alone overshoots
    assert target <= selected.sparsity <= target + tolerance
    assert selected.size == pruned_count(tiny_bert(), selected.masks, include_bias=False)
    assert sum(float(z) for z in selected.masks.mha) == 1.0  # one block removed, the other kept
    # a target the threshold already lands within tolerance: the same sparsity band
    again = binarize(masks.scores(), shape, 0.6, tolerance=0.05)
    assert 0.6 <= again.sparsity <= 0.65


# -- schedule ----------------------------------------------------------------------------------------------


def test_sp3_schedule_stages_and_variants():
    s = MaskSchedule.sp3(10)  # 2 fine-tune, 5 dimension, 15 joint epochs (D.2, §3.2)
    assert s.total_steps == 220
    assert s.levels(0) == frozenset() and s.levels(19) == frozenset()
    assert s.levels(20) == {"dimension"} and s.levels(69) == {"dimension"}
    assert s.levels(70) == {"dimension", "head", "layer"} and s.levels(219) == s.levels(70)
    assert s.stage_at(220) is None and s.levels(500) == s.levels(70)
    assert [step for step in range(221) if s.changed(step)] == [0, 20, 70]
    assert s.pruning_start() == 20
    assert MaskSchedule.sp3(10, head=False).levels(100) == {"dimension", "layer"}
    assert MaskSchedule.sp3(10, layer=False).levels(100) == {"dimension", "head"}
    assert MaskSchedule.sp3(10, head=False, layer=False).levels(100) == {"dimension"}
    short = MaskSchedule.sp3(4, finetune_epochs=0, dimension_epochs=0.5, joint_epochs=1, warmup_epochs=1)
    assert short.levels(0) == {"dimension"} and short.levels(2) == {"dimension", "head", "layer"}
    assert short.total_steps == 6
    assert [short.target(k, 0.8) for k in (0, 2, 4, 5)] == pytest.approx([0.0, 0.4, 0.8, 0.8])
    assert s.target(0, 0.8) == 0.8
    with pytest.raises(SlimkitError):
        MaskSchedule.sp3(0)


# -- hooks ---------------------------------------------------------------------------------------------------


def _inputs(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, model.config.vocab_size, (2, 9), generator=g)}


def _out(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_all_ones_masks_leave_the_model_unchanged(arch):
    model = MODELS[arch]()
    view = ModelView(model)
    inputs = _inputs(model)
    ref = _out(model, inputs)
    shape = MaskShape.from_view(view)
    names = [n for n in MASK_FIELDS if not (shape.rope and n in ("q", "k", "v", "o"))]
    placements = ["linear", "norm"] if view.spec.norm_placement == "post" else ["linear"]
    for placement in placements:
        with apply_masks(view, MaskValues.ones(shape, names), placement=placement) as hooks:
            assert hooks.handles
            assert torch.allclose(_out(model, inputs), ref, atol=1e-6)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # all removed


def _scaled_copy(model, masks: MaskValues, placement: str):
    """The same masks folded into weights: each hook point is a row/column scaling of one module."""
    model = copy.deepcopy(model)
    view = ModelView(model)
    with torch.no_grad():
        for i, layer in enumerate(view.layers):

            def rows(linear, z):
                linear.weight.mul_(z[:, None])
                if linear.bias is not None:
                    linear.bias.mul_(z)

            for role in ("q", "k", "v"):
                rows(layer.linear(role), getattr(masks, role)[i].flatten())
            o, down = layer.linear("o"), layer.linear("down")
            o.weight.mul_((masks.head[i][:, None] * masks.o[i]).flatten())
            down.weight.mul_(masks.f[i])
            rows(o, masks.mha[i].expand(o.out_features))
            rows(down, masks.ffn[i].expand(down.out_features))
            if placement == "linear":
                for role in ("q", "k", "v"):
                    layer.linear(role).weight.mul_(masks.mha_in[i])
                for role in layer.mlp_input_roles:
                    layer.linear(role).weight.mul_(masks.ffn_in[i])
                rows(o, masks.mha_out[i])
                rows(down, masks.ffn_out[i])
            else:  # norm placement, *_in only: scaling a LayerNorm's output is scaling its affine parameters
                source = (
                    view.base.get_submodule("embeddings.LayerNorm") if i == 0 else view.layer(i - 1).mlp_norm.module
                )
                for norm, z in ((source, masks.mha_in[i]), (layer.attn_norm.module, masks.ffn_in[i])):
                    norm.weight.mul_(z)
                    norm.bias.mul_(z)
    return model


@pytest.mark.parametrize("arch", ["bert", "opt", "llama"])
def test_hooks_equal_the_masks_folded_into_weights(arch):
    model = MODELS[arch]()
    view = ModelView(model)
    shape = MaskShape.from_view(view)
    g = torch.Generator().manual_seed(3)
    values = MaskValues(
        **{n: [torch.rand(shape.field_shape(n, i), generator=g) for i in range(shape.num_layers)] for n in MASK_FIELDS}
    )
    inputs = _inputs(model)
    for placement in ["linear", "norm"] if arch == "bert" else ["linear"]:
        masks = values if placement == "linear" else MaskValues(**{**values.__dict__, "mha_out": None, "ffn_out": None})
        with apply_masks(view, masks, placement=placement):
            hooked = _out(model, inputs)
        assert torch.allclose(hooked, _out(_scaled_copy(model, masks, placement), inputs), atol=1e-5)


def test_norm_placement_masks_the_layernorm_input():
    model = tiny_bert()
    view = ModelView(model)
    shape = MaskShape.from_view(view)
    a, b = _inputs(model, 0), _inputs(model, 1)
    # zeroing the last block's LayerNorm input leaves only its bias: the output no longer depends on the text
    zero_out = MaskValues.ones(shape, ["ffn_out"])
    zero_out.ffn_out[-1] = torch.zeros(shape.hidden)
    with apply_masks(view, zero_out):
        assert torch.allclose(_out(model, a), _out(model, b), atol=1e-6)
        assert torch.allclose(_out(model, a)[0, 0], view.layer(-1).mlp_norm.module.bias, atol=1e-6)
    assert not torch.allclose(_out(model, a), _out(model, b))


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_zero_ffn_channels_equal_physical_removal(arch):
    model = MODELS[arch]()
    view = ModelView(model)
    shape = MaskShape.from_view(view)
    g = torch.Generator().manual_seed(0)
    f = [(torch.rand(w, generator=g) < 0.6).float() for w in shape.ffn]
    inputs = _inputs(model)
    with apply_masks(view, MaskValues(f=f)):
        masked = _out(model, inputs)
    pruned = copy.deepcopy(model)
    for i, keep in enumerate(f):
        remove_units(pruned, layer_group(pruned, "mlp_channel", i), keep.bool().nonzero().flatten())
    assert ModelView(pruned).layer(0).mlp_width == int(f[0].sum())
    assert torch.allclose(masked, _out(pruned, inputs), atol=1e-5)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_zero_heads_equal_physical_removal(arch):
    model = MODELS[arch]()
    view = ModelView(model)
    shape = MaskShape.from_view(view)
    inputs = _inputs(model)
    gqa = shape.kv_heads[0] != shape.heads[0]
    per_group = shape.heads[0] // shape.kv_heads[0]
    keep = torch.tensor([0, 1]) if gqa else torch.tensor([0, 2, 3])  # KV groups (llama) or heads
    head = torch.zeros(shape.heads[0])
    for unit in keep.tolist():
        head[unit * per_group : (unit + 1) * per_group] = 1.0
    with apply_masks(view, MaskValues(head=[head] + [torch.ones(h) for h in shape.heads[1:]])):
        masked = _out(model, inputs)
    pruned = copy.deepcopy(model)
    remove_units(pruned, layer_group(pruned, "kv_group" if gqa else "attention_head", 0), keep)
    assert torch.allclose(masked, _out(pruned, inputs), atol=1e-5)


def test_mask_set_draws_once_per_forward_and_trains():
    model = tiny_opt()
    view = ModelView(model)
    masks = MaskSet.from_view(view, seed=0)
    inputs = _inputs(model)
    masks.train()
    with apply_masks(view, masks) as hooks:
        out = model(**inputs).logits
        drawn = hooks.values
        out.pow(2).mean().backward()
    assert all(p.grad is not None for p in masks.level_parameters("dimension"))
    # replaying the draw the hooks cached gives the same output: every hook used that one draw
    with apply_masks(view, drawn.map(lambda t: t.detach())):
        assert torch.allclose(_out(model, inputs), out.detach(), atol=1e-6)
    with pytest.raises(SlimkitError, match="built for"):
        apply_masks(ModelView(tiny_opt(layers=3)), masks)
    masks.eval()
    with apply_masks(view, masks):
        first = _out(model, inputs)
        assert torch.equal(first, _out(model, inputs))  # eval: deterministic


def test_mask_settings_are_declared_once_and_checked_once():
    from pydantic import ValidationError

    from slimkit.primitives.errors import SlimkitError
    from slimkit.primitives.masks.mask_settings import EncoderMaskSettings, MaskSettings, StreamMaskSettings
    from slimkit.primitives.masks.training import MaskTarget, run_settings
    from slimkit.stages.encoder_masks import MaskTrainEncoderArgs
    from slimkit.stages.masks import MaskTrainArgs

    with pytest.raises(SlimkitError, match=r"^mask training: target must be in \(0, 1\), got 1.5"):
        MaskTarget(1.5, 10)
    with pytest.raises(ValidationError, match="init_drop"):
        StreamMaskSettings(init_drop=1.0)
    with pytest.raises(ValidationError, match="distill"):
        EncoderMaskSettings(distill=-1.0)
    with pytest.raises(ValidationError, match="mask_learning_rate"):
        EncoderMaskSettings(mask_learning_rate=0.0)
    with pytest.raises(ValidationError, match="dimension_steps \\+ joint_steps must be >= 1"):
        EncoderMaskSettings(dimension_steps=0, joint_steps=0)
    with pytest.raises(ValidationError, match="joint_steps: 0 leaves the head and layer gates untrained"):
        EncoderMaskSettings(dimension_steps=10, joint_steps=0)
    with pytest.raises(ValidationError, match="or layer: false for dimension masks only"):
        EncoderMaskSettings(dimension_steps=10, joint_steps=0, head=False)
    assert EncoderMaskSettings(dimension_steps=10, joint_steps=0, head=False, layer=False).joint_steps == 0
    # the stages' arguments are the settings plus their data: no name is declared twice
    assert issubclass(MaskTrainArgs, StreamMaskSettings) and issubclass(MaskTrainEncoderArgs, EncoderMaskSettings)
    shared = set(MaskSettings.model_fields)
    for args, kind in ((MaskTrainArgs, StreamMaskSettings), (MaskTrainEncoderArgs, EncoderMaskSettings)):
        assert shared <= set(kind.model_fields) <= set(args.model_fields)
        assert not set(vars(args).get("__annotations__", {})) & set(kind.model_fields)
    settings = MaskTrainArgs(learning_rate=0.0, distill=0.5, batch_size=2)
    assert run_settings(settings, StreamMaskSettings, MaskTarget(0.2, 7.0), 3) == {
        **StreamMaskSettings(learning_rate=0.0, distill=0.5).model_dump(),
        "target": 0.2, "total": 7.0, "max_grad_norm": 1.0, "seed": 3,
    }  # fmt: skip
