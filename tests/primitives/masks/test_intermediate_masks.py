"""SP3's shared MHA-intermediate masks (z_Q = z_K as ``qk``, z_V = z_O as ``vo``) on a BERT encoder: the gates, the
hooks, the Eq. 30 count, training to the budget, fusing into heads of their own widths, saving and reloading."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.head_widths import HeadWidthAttention
from slimkit.primitives.io.describe import describe_model, head_dim_cell
from slimkit.primitives.masks.encoder import (
    counted_weights,
    fuse_encoder_masks,
    placeholder_size,
    train_encoder_masks,
)
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, MaskValues
from slimkit.primitives.masks.mask_settings import EncoderMaskSettings
from slimkit.primitives.masks.sparsity import expected_size
from slimkit.primitives.projection.heads import project_heads
from tests.primitives.masks.test_encoder_masks import HEADS, INTER, LAYERS, D, _batch, _model, _projected

HEAD_DIM = D // HEADS


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def _shape(model) -> MaskShape:
    return MaskShape.from_view(ModelView(model))


def _head_masks(seed: int, p: float = 0.6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(HEADS, HEAD_DIM, generator=g) < p).float() for _ in range(LAYERS)]


def test_the_mask_set_has_one_shared_gate_per_head_dimension():
    shape = _shape(_model())
    masks = MaskSet(shape, hidden="per_norm", intermediate=False, shared_intermediate=True, head=False, layer=False)
    values = masks.deterministic()
    assert values.q is values.k is values.v is values.o is None
    assert values.qk[0].shape == values.vo[2].shape == (HEADS, HEAD_DIM)
    # dimension level: norms, filters, and the qk and vo gates of every layer
    assert len(masks.level_parameters("dimension")) == 2 * LAYERS + 1 + LAYERS + 2 * LAYERS


def test_the_count_keeps_q_and_k_at_one_width_and_v_and_o_at_another():
    shape = _shape(_model())
    qk, vo = _head_masks(0), _head_masks(1)
    size = expected_size(MaskValues(qk=qk, vo=vo), shape, residual="none")
    attention = sum(D * (2 * float(a.sum()) + 2 * float(b.sum())) for a, b in zip(qk, vo, strict=True))
    assert float(size) == attention + LAYERS * 2 * D * INTER


def test_fused_heads_equal_the_masked_model_and_are_counted():
    model = _projected()
    project_heads(model, [_batch(10 + i, batch=8, length=16) for i in range(2)])
    shape = _shape(model)
    g = torch.Generator().manual_seed(4)
    qk = [m * (0.5 + 0.5 * torch.rand(m.shape, generator=g)) for m in _head_masks(2)]  # kept values below 1
    vo = _head_masks(3)
    vo[1] = torch.zeros(HEADS, HEAD_DIM)  # a layer whose heads lose every v/o dimension: an exact placeholder
    values = MaskValues(qk=qk, vo=vo)
    batches = [_batch(20 + i) for i in range(2)]
    with apply_masks(model, values, placement="norm"):
        masked = _logits(model, batches)
    report = fuse_encoder_masks(model, values, "per_norm")
    torch.testing.assert_close(_logits(model, batches), masked, rtol=1e-4, atol=1e-6)
    assert report["placeholder_head_dims"] == [1]
    assert report["head_widths"]["0"]["qk"] == [int(r.sum()) for r in qk[0].ne(0)]
    attention = model.bert.encoder.layer[2].attention.self
    assert isinstance(attention, HeadWidthAttention) and list(attention.widths.vo) == report["head_widths"]["2"]["vo"]
    row = describe_model(model).layers[2]  # slimkit inspect shows each head's widths, not the dense head_dim
    assert row["head_widths"] == report["head_widths"]["2"]
    widths = row["head_widths"]["qk"]
    assert head_dim_cell(row).startswith(f"qk {min(widths)}") and ", vo " in head_dim_cell(row)
    assert head_dim_cell({"head_dim": 64, "head_widths": {"qk": [3, 64], "vo": [8, 8]}}) == "qk 3-64, vo 8"
    assert head_dim_cell({"head_dim": 64, "head_widths": None}) == "64"
    binary = replace(
        MaskValues.ones(shape, ("mha_in", "mha_out", "ffn_in", "ffn_out")),
        qk=[(t != 0).float() for t in qk],
        vo=[(t != 0).float() for t in vo],
    )
    placeholder = D * 2  # one v row and one o column kept in layer 1
    assert placeholder_size(binary, shape) == placeholder  # what the final selection adds to Eq. 30
    assert int(expected_size(binary, shape, residual="dense")) + placeholder == counted_weights(model)


def test_placeholders_of_emptied_heads_and_filters_are_counted_as_fused():
    """A layer losing every head keeps head 0 at its kept q/k and v/o widths, a layer losing every filter keeps one
    filter: placeholder_size is exactly what the fused model counts beyond Eq. 30."""
    model = _projected()
    project_heads(model, [_batch(10 + i, batch=8, length=16) for i in range(2)])
    shape = _shape(model)
    qk, vo = _head_masks(5), _head_masks(6)
    qk[0][0] = 0.0  # layer 0's head 0 keeps no q/k dimension: its placeholder keeps one
    head = [torch.ones(HEADS) for _ in range(LAYERS)]
    head[0] = torch.zeros(HEADS)
    f = [torch.ones(INTER) for _ in range(LAYERS)]
    f[2] = torch.zeros(INTER)
    binary = replace(MaskValues.ones(shape, ("mha_in", "mha_out", "ffn_in", "ffn_out")), qk=qk, vo=vo, head=head, f=f)
    hand = (2 * 1 + int(vo[0][0].sum())) * D + int(vo[0][0].sum()) * D + 2 * D  # head 0 of layer 0; a filter
    assert placeholder_size(binary, shape) == hand
    fuse_encoder_masks(model, binary, "per_norm")
    assert int(expected_size(binary, shape, residual="dense")) + hand == counted_weights(model)


@pytest.mark.slow
@pytest.mark.parametrize("layer", [False, True])
def test_training_lands_on_the_budget_and_the_saved_model_reloads_equal(tmp_path, layer):
    """All three levels (dimension with the MHA-intermediate masks, head, and with ``layer`` the block gates that
    remove a third of the tiny model's count at once): the target is met and not overshot."""
    model = _projected()
    batches = [_batch(30 + i, batch=4, labels=True) for i in range(3)]
    settings = EncoderMaskSettings(finetune_steps=1, dimension_steps=3, joint_steps=3, intermediate=True, layer=layer)
    report = train_encoder_masks(model, batches, settings, 0.4, check_batches=[_batch(7)], tolerance=0.005)
    assert report["levels"] == (["dimension", "head", "layer"] if layer else ["dimension", "head"])
    assert 0.4 <= report["binary_sparsity"] <= 0.405  # the budget-aware selection, q/k/v/o at their kept widths
    assert report["counted_weights"] - report["fused"]["placeholder_params"] == report["binary_size"]
    assert report["heads_projection"]["tokens"] > 0
    widths = report["fused"]["head_widths"]
    assert set(widths) == {"0", "1", "2"} and any(w < HEAD_DIM for layer in widths.values() for w in layer["qk"])
    agreement = report["fused"]["masked_vs_fused"]
    assert agreement["max_abs_logit_diff"] < 1e-4 and agreement["prediction_agreement"] == 1.0
    checks = [_batch(40 + i) for i in range(2)]
    expected = _logits(model, checks)
    slimkit.save(model, None, tmp_path / "model")
    loaded, _ = slimkit.load(tmp_path / "model", device="cpu")
    torch.testing.assert_close(_logits(loaded, checks), expected)
    assert [list(loaded.bert.encoder.layer[i].attention.self.widths.qk) for i in range(LAYERS)] == [
        widths[str(i)]["qk"] for i in range(LAYERS)
    ]


@pytest.mark.slow
def test_identity_basis_masks_raw_head_dimensions(monkeypatch):
    """Table 3's ablation (intermediate_basis: identity): no head projection is computed, the gates act on the raw
    q/k and v/o dimensions, and the budget, the per-head fusing and the masked = fused equality still hold."""
    import slimkit.primitives.masks.encoder as encoder

    def refuse(*args, **kwargs):
        raise AssertionError("the identity basis must not project the heads")

    monkeypatch.setattr(encoder, "project_heads", refuse)
    model = _projected()
    batches = [_batch(30 + i, batch=4, labels=True) for i in range(3)]
    settings = EncoderMaskSettings(
        dimension_steps=3, joint_steps=3, intermediate=True, intermediate_basis="identity", layer=False
    )
    report = train_encoder_masks(model, batches, settings, 0.4, check_batches=[_batch(7)], tolerance=0.005)
    assert report["heads_projection"] is None
    assert 0.4 <= report["binary_sparsity"] <= 0.405
    assert report["fused"]["head_widths"]
    agreement = report["fused"]["masked_vs_fused"]
    assert agreement["max_abs_logit_diff"] < 1e-4 and agreement["prediction_agreement"] == 1.0
