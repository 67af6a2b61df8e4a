"""SP3 / CoFi masks on post-norm encoders (:mod:`slimkit.primitives.masks.encoder`, ``mask_train_encoder``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import BertConfig, BertForSequenceClassification

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.glue_metrics import evaluate_glue
from slimkit.primitives.masks.encoder import counted_weights, fuse_encoder_masks, train_encoder_masks
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, MaskValues
from slimkit.primitives.masks.mask_settings import EncoderMaskSettings
from slimkit.primitives.masks.sparsity import expected_size
from slimkit.primitives.projection import project_post_norm
from slimkit.recipes.loading import validate
from tests.tiny import shrink_encoder_recipe, tiny_bert

D, LAYERS, HEADS, INTER, VOCAB = 32, 3, 4, 48, 100
RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def _model(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        max_position_embeddings=64,
        num_labels=2,
        layer_norm_eps=0.05,
    )
    model = BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _batch(seed: int, batch: int = 3, length: int = 12, labels: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, length - 3 :] = 0
    out = {"input_ids": ids * mask, "attention_mask": mask}
    if labels:
        out["labels"] = torch.randint(0, 2, (batch,), generator=generator)
    return out


def _projected(seed: int = 0) -> BertForSequenceClassification:
    model = _model(seed)
    project_post_norm(model, [_batch(10 + i, batch=8, length=16) for i in range(2)])
    return model


def _binary(shape: MaskShape, seed: int, layer_masks: bool = True) -> MaskValues:
    """Random per-norm 0/1 hidden masks, fractional kept head / filter / layer values, some zeroed."""
    g = torch.Generator().manual_seed(seed)
    z = [(torch.rand(D, generator=g) < 0.6).float() for _ in range(2 * LAYERS + 1)]
    for zj in z:
        zj[int(torch.randint(0, D, (1,), generator=g))] = 1.0
    n = LAYERS

    def frac(size: int, p: float) -> torch.Tensor:
        keep = (torch.rand(size, generator=g) < p).float()
        return keep * (0.5 + 0.5 * torch.rand(size, generator=g))

    head = [frac(HEADS, 0.6) for _ in range(n)]
    head[1] = torch.zeros(HEADS)  # every head gone: a placeholder head keeps the layer running
    values = MaskValues(
        mha_in=[z[2 * i] for i in range(n)],
        mha_out=[z[2 * i + 1] for i in range(n)],
        ffn_in=[z[2 * i + 1] for i in range(n)],
        ffn_out=[z[2 * i + 2] for i in range(n)],
        f=[frac(INTER, 0.5) for _ in range(n)],
        head=head,
    )
    if layer_masks:
        values.mha = [torch.tensor(0.7), torch.tensor(1.0), torch.tensor(0.0)]
        values.ffn = [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(0.8)]
    return values


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def test_per_norm_mask_set_maps_one_gate_per_norm():
    shape = MaskShape.from_view(slimkit.primitives.arch.ModelView(_model()))
    masks = MaskSet(shape, hidden="per_norm", intermediate=False)
    assert len(masks.norm_hidden) == 2 * LAYERS + 1
    values = masks.deterministic()
    for i in range(LAYERS):
        assert values.mha_out[i] is values.ffn_in[i]
        if i + 1 < LAYERS:
            assert values.ffn_out[i] is values.mha_in[i + 1]
    assert len(masks.level_parameters("dimension")) == 2 * LAYERS + 1 + LAYERS  # norms + filters


def test_rank_prior_tilts_every_per_norm_gate_and_not_a_shared_one():
    from slimkit.primitives.masks.mask_set import apply_rank_prior

    shape = MaskShape.from_view(slimkit.primitives.arch.ModelView(_model()))
    masks = MaskSet(shape, hidden="per_norm", intermediate=False, init_std=0.0, init_drop=0.05)
    start = float(masks.norm_hidden[0].log_alpha.detach()[0])  # log(0.95 / 0.05) everywhere
    apply_rank_prior(masks, 4.0)
    for gate in masks.norm_hidden:  # coordinate k of 32 moves by 4 (1/2 - k/31): +2 first, -2 last, mean kept
        expected = start + 4.0 * (0.5 - torch.arange(D) / (D - 1))
        torch.testing.assert_close(gate.log_alpha.detach(), expected)
    assert float(masks.gates["f"][0].log_alpha.detach()[0]) == pytest.approx(start)  # filter gates are not PCA-ordered
    shared = MaskSet(shape, hidden="shared", intermediate=False, init_std=0.0, init_drop=0.05)
    apply_rank_prior(shared, 4.0)
    assert bool((shared.shared_hidden.log_alpha == start).all())


def test_rank_prior_needs_pca_ordered_hidden_gates():
    from pydantic import ValidationError

    from slimkit.primitives.masks.mask_settings import StreamMaskSettings

    assert EncoderMaskSettings(rank_prior=4.0).rank_prior == 4.0
    for hidden in ("shared", "none"):
        with pytest.raises(ValidationError, match=f"needs hidden: per_norm .*hidden: {hidden} has none"):
            EncoderMaskSettings(hidden=hidden, rank_prior=4.0)
    with pytest.raises(ValidationError, match="hidden: false has none"):
        StreamMaskSettings(hidden=False, rank_prior=4.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_per_norm_model_equals_the_masked_projected_model(seed):
    model = _projected()
    shape = MaskShape.from_view(slimkit.primitives.arch.ModelView(model))
    values = _binary(shape, seed)
    batches = [_batch(20 + i) for i in range(2)]
    with apply_masks(model, values, placement="norm", ends=True):
        masked = _logits(model, batches)
    report = fuse_encoder_masks(model, values, "per_norm")
    assert report["placeholder_heads"] == [1, 2] and report["placeholder_filters"] == [1]
    torch.testing.assert_close(_logits(model, batches), masked, rtol=1e-4, atol=1e-5)


def test_mask_set_with_ends_equals_fixed_values():
    model = _projected()
    masks = MaskSet.from_view(slimkit.primitives.arch.ModelView(model), hidden="per_norm", intermediate=False, seed=0)
    masks.eval()
    batches = [_batch(5)]
    with apply_masks(model, masks):  # per_norm: ends on by default
        by_set = _logits(model, batches)
    with apply_masks(model, masks.deterministic(), placement="norm", ends=True):
        by_values = _logits(model, batches)
    torch.testing.assert_close(by_set, by_values)
    with apply_masks(model, masks.deterministic(), placement="norm"):
        without_ends = _logits(model, batches)
    assert not torch.allclose(by_set, without_ends)


def test_binary_count_equals_the_fused_models_counted_weights():
    model = _projected()
    shape = MaskShape.from_view(slimkit.primitives.arch.ModelView(model))
    values = _binary(shape, 2, layer_masks=False)
    values.head[1] = torch.ones(HEADS)  # no placeholder: the count then matches exactly
    binary = values.map(lambda t: (t != 0).float())
    count = expected_size(binary, shape, residual="dense")
    report = fuse_encoder_masks(model, values, "per_norm")
    assert report["placeholder_params"] == 0
    assert int(count) == counted_weights(model) == report["counted_weights"]
    unmasked = _projected()
    full = MaskValues.ones(shape, ("mha_in", "mha_out", "ffn_in", "ffn_out"))
    assert int(expected_size(full, shape, residual="dense")) == counted_weights(unmasked)


def test_shared_mode_slices_layernorms_and_counts_blocks():
    model = _model()
    shape = MaskShape.from_view(slimkit.primitives.arch.ModelView(model))
    g = torch.Generator().manual_seed(0)
    z = (torch.rand(D, generator=g) < 0.7).float()
    values = MaskValues(**{h: [z] * LAYERS for h in ("mha_in", "mha_out", "ffn_in", "ffn_out")})
    values.f = [(torch.rand(INTER, generator=g) < 0.5).float() for _ in range(LAYERS)]
    count = expected_size(values, shape, residual="none")
    fuse_encoder_masks(model, values, "shared")
    assert int(count) == counted_weights(model)
    assert model.bert.embeddings.LayerNorm.weight.shape == (int(z.sum()),)
    _logits(model, [_batch(1)])  # runs


def test_training_reaches_the_target_and_reports():
    model = _projected()
    batches = [_batch(30 + i, batch=4, labels=True) for i in range(3)]
    settings = EncoderMaskSettings(finetune_steps=1, dimension_steps=3, joint_steps=3, distill=1.0, rank_prior=2.0)
    report = train_encoder_masks(model, batches, settings, 0.4, check_batches=[_batch(7)])
    assert report["steps"] == 7 and report["levels"] == ["dimension", "head", "layer"]
    assert report["config"]["rank_prior"] == 2.0
    assert report["binary_sparsity"] >= 0.4
    assert report["binary_sparsity"] <= 0.4 + 0.005  # the budget-aware selection, default tolerance
    placeholder = report["fused"]["placeholder_params"]
    assert report["counted_weights"] - placeholder == report["binary_size"]
    agreement = report["fused"]["masked_vs_fused"]
    assert agreement["max_abs_logit_diff"] < 1e-4 and agreement["prediction_agreement"] == 1.0
    with pytest.raises(SlimkitError, match="per_norm needs a model projected"):
        train_encoder_masks(_model(), batches, settings, 0.4)


# ---- recipes end to end -------------------------------------------------------------------------------------


@pytest.fixture
def tiny_bert_dir(tmp_path, tokenizer):
    path = tmp_path / "tiny-bert"
    tiny_bert(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _shrink(raw: dict, model_dir: Path) -> dict:
    raw = shrink_encoder_recipe(raw, model_dir)
    raw["eval"] = {"glue": {"limit": 16, "batch_size": 8, "max_length": 32}}
    return raw


@pytest.mark.parametrize("name", ["sp3-bert", "cofi-bert"])
def test_recipe_end_to_end(tmp_path, tiny_bert_dir, name):
    raw = _shrink(yaml.safe_load((RECIPES / f"{name}.yaml").read_text()), tiny_bert_dir)
    # Binarising stops at the first threshold that meets the target, so it overshoots by up to one
    # unit: one hidden feature of the 32-wide tiny encoder is 224 of its 7,168 matrix weights per
    # layer (3.1%), more than a 3% tolerance (CI once measured 53.19% on another CPU).
    raw["target"]["tolerance"] = 0.05
    out = tmp_path / "run"
    report = slimkit.run(validate(raw, name), out).report.as_json()
    stage = report["stages"]["mask_train_encoder"]
    assert stage["steps"] == 5 and stage["binary_sparsity"] >= raw["target"]["ratio"]
    # the task fine-tune and the recovery fine-tune each keep their report
    assert report["stages"]["glue_finetune"]["steps"] == report["stages"]["glue_finetune#2"]["steps"] == 2
    assert set(report["metrics"]) == {"glue_sst2_accuracy"}
    model, tokenizer = slimkit.load(out / "model")
    assert isinstance(model, BertForSequenceClassification)
    result = evaluate_glue(model, tokenizer, "sst2", limit=16, batch_size=8, max_length=32)
    assert result["accuracy"] == report["metrics"]["glue_sst2_accuracy"]
    agreement = stage["fused"]["masked_vs_fused"]
    if name == "sp3-bert":  # slicing a projected model is exact; CoFi's sliced LayerNorms are not
        assert report["stages"]["pca_project_post"]["residual_matrices"] == 4
        assert agreement["prediction_agreement"] == 1.0 and agreement["max_abs_logit_diff"] < 1e-4
    else:
        assert 0.0 <= agreement["prediction_agreement"] <= 1.0
    print(name, {k: stage[k] for k in ("binary_sparsity", "achieved_sparsity", "levels")}, agreement)


@pytest.mark.slow
def test_layer_masks_land_within_the_tolerance(tmp_path, tiny_bert_dir):
    """With block gates (z_MHA, z_FFN) the budget-aware selection keeps the result in [ratio, ratio + tolerance]."""
    raw = _shrink(yaml.safe_load((RECIPES / "sp3-bert.yaml").read_text()), tiny_bert_dir)
    raw["stages"][2]["args"]["layer"] = True
    raw["target"]["tolerance"] = 0.01
    report = slimkit.run(validate(raw, "sp3-bert"), tmp_path / "run").report.as_json()
    stage = report["stages"]["mask_train_encoder"]
    assert stage["levels"] == ["dimension", "head", "layer"]
    assert 0.5 <= stage["binary_sparsity"] <= 0.5 + 0.01
    assert stage["fused"]["masked_vs_fused"]["prediction_agreement"] == 1.0
