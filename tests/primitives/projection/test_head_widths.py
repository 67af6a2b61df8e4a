"""SP3's MHA-intermediate projections on a BERT model and heads with their own widths
(:mod:`slimkit.primitives.projection.heads`, :mod:`slimkit.primitives.arch.head_widths`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.head_widths import HeadWidthAttention, HeadWidths, head_width_refusal
from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.projection.heads import gram_root, project_heads, slice_heads
from tests.primitives.masks.test_encoder_masks import HEADS, _batch, _model, _projected

HEAD_DIM = 8


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def _calibration():
    return [_batch(10 + i, batch=8, length=16) for i in range(2)]


def _random_keep(seed: int, p: float = 0.5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keep = [(torch.rand(HEAD_DIM, generator=g) < p).nonzero().flatten() for _ in range(HEADS)]
    keep[0] = torch.tensor([0, 3])  # never all empty
    return keep


def _zero_rows(model, layer: int, qk: list[torch.Tensor], vo: list[torch.Tensor]) -> None:
    """The masked full-width model: the removed dimensions' q (and k) and v rows set to zero."""
    attention = model.bert.encoder.layer[layer].attention.self
    with torch.no_grad():
        for h in range(HEADS):
            for j in range(HEAD_DIM):
                if j not in qk[h]:
                    for linear in (attention.query, attention.key):
                        linear.weight[h * HEAD_DIM + j] = 0
                        linear.bias[h * HEAD_DIM + j] = 0
                if j not in vo[h]:
                    attention.value.weight[h * HEAD_DIM + j] = 0
                    attention.value.bias[h * HEAD_DIM + j] = 0


def test_gram_root_reproduces_the_gram():
    x = torch.randn(50, 6, dtype=torch.float64)
    root = gram_root(x.T @ x)
    torch.testing.assert_close(root.T @ root, x.T @ x)


@pytest.mark.parametrize("projected", [False, True])
def test_projection_at_full_width_keeps_the_outputs(projected):
    model = _projected() if projected else _model()
    batches = [_batch(20 + i) for i in range(2)]
    before = _logits(model, batches)
    weight = model.bert.encoder.layer[1].attention.self.query.weight.detach().clone()
    report = project_heads(model, _calibration())
    assert not torch.allclose(model.bert.encoder.layer[1].attention.self.query.weight, weight)
    torch.testing.assert_close(_logits(model, batches), before, rtol=1e-4, atol=1e-5)
    assert report["tokens"] > 0 and len(report["sigma_qk"]) == len(report["sigma_v"]) == 3
    for sigma in report["sigma_v"][0]:  # each head's dimensions in order of value energy
        assert sigma == sorted(sigma, reverse=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_sliced_heads_equal_the_masked_model(seed):
    model = _model()
    project_heads(model, _calibration())
    qk, vo = _random_keep(seed), _random_keep(seed + 10)
    _zero_rows(model, 1, qk, vo)
    batches = [_batch(20 + i) for i in range(2)]
    masked = _logits(model, batches)
    widths = slice_heads(model, 1, qk, vo)
    assert widths == HeadWidths(tuple(len(k) for k in qk), tuple(len(k) for k in vo))
    attention = model.bert.encoder.layer[1].attention.self
    assert isinstance(attention, HeadWidthAttention)
    assert attention.query.weight.shape[0] == attention.key.weight.shape[0] == sum(widths.qk)
    assert model.bert.encoder.layer[1].attention.output.dense.weight.shape[1] == sum(widths.vo)
    torch.testing.assert_close(_logits(model, batches), masked, rtol=1e-4, atol=1e-6)


def test_a_masked_dimension_is_removed_by_hand():
    """Head 0 keeps q/k dimensions 0 and 2 and v/o dimension 1: exactly those rows and that column remain."""
    model = _model()
    attention = model.bert.encoder.layer[0].attention.self
    query, value = attention.query.weight.detach().clone(), attention.value.weight.detach().clone()
    dense = model.bert.encoder.layer[0].attention.output.dense.weight.detach().clone()
    full = torch.arange(HEAD_DIM)
    slice_heads(model, 0, [torch.tensor([0, 2]), full, full, full], [torch.tensor([1]), full, full, full])
    attention = model.bert.encoder.layer[0].attention.self
    assert attention.widths == HeadWidths((2, 8, 8, 8), (1, 8, 8, 8))
    torch.testing.assert_close(attention.query.weight[:2], query[[0, 2]])
    torch.testing.assert_close(attention.query.weight[2:], query[8:])
    torch.testing.assert_close(attention.value.weight[0], value[1])
    torch.testing.assert_close(model.bert.encoder.layer[0].attention.output.dense.weight[:, 0], dense[:, 1])
    layer = ModelView(model).layer(0)
    assert layer.num_heads == HEADS and layer.head_dim == HEAD_DIM and layer.head_widths == attention.widths
    with pytest.raises(SlimkitError, match="need heads of one width"):
        build_groups(model, "attention_head")


def test_saved_and_reloaded_with_equal_outputs(tmp_path):
    model = _projected()
    project_heads(model, _calibration())
    for layer in range(3):
        slice_heads(model, layer, _random_keep(layer), _random_keep(layer + 5))
    batches = [_batch(20 + i) for i in range(2)]
    expected = _logits(model, batches)
    slimkit.save(model, None, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "slimkit_manifest.json").read_text())
    entries = [e for e in manifest["modules"] if e["kind"] == "head_widths"]
    assert [e["qk_widths"] for e in entries] == [[len(k) for k in _random_keep(i)] for i in range(3)]
    loaded, _ = slimkit.load(tmp_path / "out", device="cpu")
    assert isinstance(loaded.bert.encoder.layer[2].attention.self, HeadWidthAttention)
    torch.testing.assert_close(_logits(loaded, batches), expected)


def test_an_edited_width_is_refused_on_load(tmp_path):
    model = _model()
    slice_heads(model, 0, _random_keep(0), _random_keep(1))
    slimkit.save(model, None, tmp_path / "out")
    path = tmp_path / "out" / "slimkit_manifest.json"
    manifest = json.loads(path.read_text())
    entry = next(e for e in manifest["modules"] if e["kind"] == "head_widths")
    entry["qk_widths"][0] += 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(SlimkitError, match=r"head_widths at bert\.encoder\.layer\.0\.attention\.self"):
        slimkit.load(tmp_path / "out", device="cpu")


def test_models_that_cannot_keep_per_head_widths():
    assert head_width_refusal(ARCH_SPECS["bert"]) is None
    assert "RoPE" in head_width_refusal(ARCH_SPECS["llama"])
    assert "decoder" in head_width_refusal(ARCH_SPECS["opt"])
    assert "q_norm" in head_width_refusal(replace(ARCH_SPECS["bert"], q_norm="attention.self.q_norm"))
