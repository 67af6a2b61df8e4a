"""SP3 hidden-dimension projection of post-LayerNorm BERT encoders (:mod:`slimkit.primitives.projection.postnorm`)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, BertModel

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection import (
    GramAccumulator,
    basis_change_params,
    basis_changes,
    centring_matrix,
    hidden_norms,
    norm_statistics,
    pca,
    project_post_norm,
    slice_post_norm_hidden,
)
from tests.tiny import assert_scaled_close, tiny_llama

D, LAYERS, INTER, VOCAB, POS, TYPES, LABELS = 32, 3, 64, 100, 64, 2, 3


def _config() -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=INTER,
        max_position_embeddings=POS,
        type_vocab_size=TYPES,
        num_labels=LABELS,
        layer_norm_eps=0.05,  # large, so that the ε handling of the RMSNorms (ε·d/k) is tested too
    )


def _randomise(model: nn.Module) -> nn.Module:
    # LayerNorm γ, β and all biases random, so that every term of Eq. 8 and Eq. 18 matters.
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _model(cls=BertForSequenceClassification, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _randomise(cls(_config()))


def _batch(seed: int, batch: int = 3, length: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):  # padded rows of different lengths
        mask[row, length - 2 * row :] = 0
    ids = ids * mask
    types = (torch.arange(length)[None] >= length // 2).long().expand(batch, -1) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _batches() -> list[dict[str, torch.Tensor]]:
    return [_batch(10 + i) for i in range(3)]


def _outputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**batch)
        found = {k: out[k] for k in ("logits", "pooler_output", "last_hidden_state") if k in out}
        if isinstance(model, BertForSequenceClassification):
            found["pooler_output"] = model.bert(**batch).pooler_output
    return found


def _mask_norms(model: nn.Module, keep: list[torch.Tensor]) -> None:
    """Multiply the input and the output of every hidden norm j by the 0/1 mask of ``keep[j]``."""
    for path, k in zip(hidden_norms(model), keep, strict=True):
        norm = model.get_submodule(path)
        mask = torch.zeros(norm.weight.shape[0])
        mask[k] = 1.0
        norm.register_forward_pre_hook(lambda _m, args, mask=mask: (args[0] * mask, *args[1:]))
        # prepend: mask before a restoring output map the norm may carry
        norm.register_forward_hook(lambda _m, _args, out, mask=mask: out * mask, prepend=True)


def _expected_params(widths: list[int], pooler: bool = True, classifier: bool = True) -> tuple[int, int]:
    """``(total, residual)`` of a projected BertForSequenceClassification with hidden-norm widths ``widths``."""
    total = (VOCAB + POS + TYPES) * widths[0] + widths[0]  # tables and norm 0 (RMSNorm: weight only)
    residual = 0
    for layer in range(LAYERS):
        a, b, c = widths[2 * layer : 2 * layer + 3]
        total += 3 * (D * a + D)  # q, k, v read stream 2l (attention width stays D)
        total += b * D + b + b  # attention output dense and its norm
        total += INTER * b + INTER  # intermediate dense reads stream 2l+1
        total += c * INTER + c + c  # FFN output dense and its norm
        residual += b * a + c * b
    if pooler:
        total += D * widths[-1] + D
    if classifier:
        total += LABELS * D + LABELS
    return total + residual, residual


# -- tests ------------------------------------------------------------------------------------------------
def test_hidden_norms_are_numbered_embeddings_then_attention_then_output():
    paths = hidden_norms(_model())
    assert len(paths) == 2 * LAYERS + 1
    assert paths[:3] == [
        "bert.embeddings.LayerNorm",
        "bert.encoder.layer.0.attention.output.LayerNorm",
        "bert.encoder.layer.0.output.LayerNorm",
    ]
    assert hidden_norms(_model(BertModel))[-1] == f"encoder.layer.{LAYERS - 1}.output.LayerNorm"
    with pytest.raises(SlimkitError, match="post-norm projection handles BERT"):
        hidden_norms(tiny_llama(layers=1))


def test_streamed_statistics_equal_pca_of_concatenated_unpadded_features():
    model = _model(BertModel)
    batches = _batches()
    captured: list[list[torch.Tensor]] = [[] for _ in hidden_norms(model)]
    handles = [
        model.get_submodule(path).register_forward_pre_hook(lambda _m, args, j=j: captured[j].append(args[0]))
        for j, path in enumerate(hidden_norms(model))
    ]
    for batch in batches:
        _outputs(model, batch)
    for handle in handles:
        handle.remove()
    accumulators = norm_statistics(model, batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    for j, accumulator in enumerate(accumulators):
        features = torch.cat([y[b["attention_mask"].bool()] for y, b in zip(captured[j], batches, strict=True)])
        assert isinstance(accumulator, GramAccumulator) and accumulator.tokens == tokens == features.shape[0]
        reference = pca(features, centre="token")
        streamed = accumulator.components()
        torch.testing.assert_close(streamed.values, reference.values, rtol=1e-8, atol=1e-8)
        # compare the components with a clear spectral gap (the all-ones direction's value is ~0)
        torch.testing.assert_close(streamed.vectors[:, :20], reference.vectors[:, :20], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("cls", "restore_output"),
    [(BertForSequenceClassification, False), (BertModel, False), (BertModel, True)],
)
def test_full_rank_projection_is_exact_and_residual_matrices_follow_eq_18(cls, restore_output):
    model = _model(cls)
    batch = _batch(99)
    before = _outputs(model, batch)
    paths = hidden_norms(model)
    norms = [copy.deepcopy(model.get_submodule(p)) for p in paths]
    bases = [acc.components().vectors for acc in norm_statistics(model, _batches())]
    report = project_post_norm(model, _batches(), restore_output=restore_output)
    after = _outputs(model, batch)
    assert_scaled_close(after["pooler_output"], before["pooler_output"])
    if "logits" in before:
        assert_scaled_close(after["logits"], before["logits"])
    if restore_output:
        assert_scaled_close(after["last_hidden_state"], before["last_hidden_state"])
    elif "last_hidden_state" in before:  # the sequence output is x̂_2L; diag(γ) U x̂ + β gives the original back
        last = norms[-1]
        restored = (after["last_hidden_state"].double() @ bases[-1].T) * last.weight.double() + last.bias.double()
        assert_scaled_close(restored.float(), before["last_hidden_state"])
    assert report["widths"] == [D] * len(paths) and all(e == pytest.approx(1.0) for e in report["explained"])
    assert report["tokens"] == sum(int(b["attention_mask"].sum()) for b in _batches()) and not report["rank_deficient"]
    assert all(isinstance(model.get_submodule(p), nn.RMSNorm) for p in paths)
    # Eq. 18: W_R = U_jᵀ R diag(γ_{j-1}) U_{j-1} on the residual of the block feeding norm j
    adapters = dict(basis_changes(model))
    r = centring_matrix(D)
    for j in range(1, len(paths)):
        host = paths[j].rpartition(".")[0]
        expected = bases[j].T @ r @ (norms[j - 1].weight.double()[:, None] * bases[j - 1])
        assert adapters[f"{host}.basis_change"].hook == "residual"
        torch.testing.assert_close(adapters[f"{host}.basis_change"].weight.double(), expected, rtol=0, atol=1e-6)
    assert len(adapters) == 2 * LAYERS + int(restore_output)
    assert report["residual_params"] == basis_change_params(model) == 2 * LAYERS * D * D + restore_output * (D * D + D)
    assert report["params"] - report["params_without_residual"] == report["residual_params"]


def test_residual_hook_maps_input_tensor_given_positionally_or_by_keyword():
    model = _model(BertModel)
    project_post_norm(model, _batches())
    host = model.encoder.layer[1].attention.output
    hidden, residual = torch.randn(2, 5, D), torch.randn(2, 5, D)
    with torch.no_grad():
        positional = host(hidden, residual)
        keyword = host(hidden_states=hidden, input_tensor=residual)
        plain = host.LayerNorm(host.dense(hidden) + host.basis_change(residual))
    torch.testing.assert_close(positional, keyword)
    torch.testing.assert_close(positional, plain)


def test_truncated_projection_has_the_expected_size_and_equals_full_rank_then_slicing():
    widths = [30, 28, 24, 26, 20, 22, 18]
    truncated = _model()
    report = project_post_norm(truncated, _batches(), widths)
    total, residual = _expected_params(widths)
    assert report["widths"] == widths and report["params"] == total and report["residual_params"] == residual
    assert report["params"] == sum(p.numel() for p in truncated.parameters())
    assert all(0 < e < 1 for e in report["explained"])
    full = _model()
    project_post_norm(full, _batches())
    slice_post_norm_hidden(full, [torch.arange(k) for k in widths])
    batch = _batch(7)
    out_truncated, out_sliced = _outputs(truncated, batch), _outputs(full, batch)
    assert torch.isfinite(out_truncated["logits"]).all()
    assert_scaled_close(out_sliced["logits"], out_truncated["logits"], 1e-5)


def _random_keep(widths: list[int], sizes: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randperm(n, generator=generator)[:k].sort().values for n, k in zip(widths, sizes, strict=True)]


@pytest.mark.parametrize("restore_output", [False, True])
def test_slicing_equals_masking_the_norms(restore_output):
    widths = [30, 32, 28, 31, 26, 29, 27]
    sizes = [21, 17, 25, 12, 19, 23, 14]
    cls = BertModel if restore_output else BertForSequenceClassification
    model = _model(cls)
    project_post_norm(model, _batches(), widths, restore_output=restore_output)
    keep = _random_keep(widths, sizes, seed=5)
    masked, sliced = copy.deepcopy(model), copy.deepcopy(model)
    _mask_norms(masked, keep)
    report = slice_post_norm_hidden(sliced, keep)
    assert report["widths"] == sizes
    paths = hidden_norms(sliced)
    assert [sliced.get_submodule(p).weight.shape[0] for p in paths] == sizes
    if not restore_output:
        assert report["params"] == _expected_params(sizes)[0]
    batch = _batch(21)
    out_masked, out_sliced = _outputs(masked, batch), _outputs(sliced, batch)
    assert set(out_sliced) == set(out_masked)
    for key, value in out_masked.items():
        if key == "last_hidden_state" and not restore_output:  # projected coordinates: compare on keep[2L]
            value = value[..., keep[-1]]
        assert_scaled_close(out_sliced[key], value, 1e-5)
    with pytest.raises(SlimkitError, match="keep"):
        slice_post_norm_hidden(sliced, [torch.tensor([1, 0])] * len(paths))


@pytest.mark.parametrize("restore_output", [False, True])
def test_sliced_projected_model_saves_and_reloads_with_equal_outputs(restore_output, tmp_path):
    cls = BertModel if restore_output else BertForSequenceClassification
    model = _model(cls)
    project_post_norm(model, _batches(), [31, 30, 29, 28, 27, 26, 25], restore_output=restore_output)
    slice_post_norm_hidden(model, _random_keep([31, 30, 29, 28, 27, 26, 25], [20, 22, 18, 24, 16, 21, 19], seed=8))
    batch = _batch(33)
    before = _outputs(model, batch)
    path = slimkit.save(model, None, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert [config["per_layer_config"][str(i)]["hidden_size"] for i in range(LAYERS)] == [20, 18, 16]
    manifest = json.loads((path / "slimkit_manifest.json").read_text())
    hooks = [m["hook"] for m in manifest["modules"] if m["kind"] == "basis_change"]
    assert sorted(hooks) == ["output"] * restore_output + ["residual"] * (2 * LAYERS)
    loaded, _ = slimkit.load(path, task="encoder")
    assert type(loaded) is cls
    after = _outputs(loaded, batch)
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=1e-6)
    assert basis_change_params(loaded) == basis_change_params(model)


def test_bad_arguments_raise_slimkit_errors():
    model = _model()
    with pytest.raises(SlimkitError, match="as many widths"):
        project_post_norm(model, _batches(), [D] * 3)
    with pytest.raises(SlimkitError, match="widths must lie"):
        project_post_norm(model, _batches(), [D + 1] * (2 * LAYERS + 1))
    with pytest.raises(SlimkitError, match="needs a model projected"):
        slice_post_norm_hidden(model, [torch.arange(4)] * (2 * LAYERS + 1))
    project_post_norm(model, [b["input_ids"] for b in _batches()])  # plain id tensors work too
    with pytest.raises(SlimkitError, match="only once"):
        project_post_norm(model, _batches())
