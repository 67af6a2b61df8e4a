"""SP3's LLM masks (Appendix F): per-group hidden masks on the stream, FFN filters, fusing, the whole-model count."""

from __future__ import annotations

import copy

import pytest
import torch

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.fusing import fuse_stream_masks, stream_count_args
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, MaskValues
from slimkit.primitives.masks.sparsity import binarize, stream_model_size
from slimkit.primitives.projection import (
    ProjectionSettings,
    project_hidden_dimension,
    slice_stream,
    stream_groups,
)
from tests.tiny import assert_scaled_close, model_output, tiny_llama, tiny_opt

MODELS = {
    "llama-tied": lambda: tiny_llama(layers=4),
    "llama-untied": lambda: tiny_llama(layers=4, tie=False),
    "opt": lambda: tiny_opt(layers=4),
    "llama-tied-own": lambda: tiny_llama(layers=4),  # the tied embedding in its own basis (tied_head="own")
}
TIED_HEAD = {"llama-tied-own": "own"}


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(seed))


def _projected(family: str, group_size: int | None = 2):
    model = MODELS[family]()
    with torch.no_grad():  # a stream of O(1) like real models', so the norms' ε stays negligible (see slice.py)
        ModelView(model).embed_tokens.weight.mul_(50.0)
    batches = [_ids(seed) for seed in (5, 6)]
    settings = ProjectionSettings(group_size=group_size, ratio=0.0, tied_head=TIED_HEAD.get(family, "joint"))
    project_hidden_dimension(model, batches, settings)
    return model.eval()


def _random_values(model, groups, seed: int, fractional: bool) -> MaskValues:
    generator = torch.Generator().manual_seed(seed)
    shape = MaskShape.from_view(ModelView(model))

    def draw(n: int) -> torch.Tensor:
        keep = (torch.rand(n, generator=generator) > 0.4).float()
        keep[torch.randint(n, (1,), generator=generator)] = 1.0
        if fractional:
            keep = keep * (0.5 + torch.rand(n, generator=generator))
        return keep

    per_group = [draw(shape.hidden) for _ in groups]
    per_layer = [per_group[g] for g, layers in enumerate(groups) for _ in layers]
    hidden = {name: list(per_layer) for name in ("mha_in", "mha_out", "ffn_in", "ffn_out")}
    return MaskValues(**hidden, f=[draw(n) for n in shape.ffn])


def test_stream_groups_follow_the_residual_matrices():
    model = _projected("llama-untied", group_size=2)
    assert stream_groups(model) == [range(0, 2), range(2, 4)]
    assert stream_groups(tiny_llama(layers=3)) == [range(0, 3)]


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("fractional", [False, True])
def test_fused_stream_masks_equal_the_masked_model(family, fractional):
    model = _projected(family)
    groups = stream_groups(model)
    values = _random_values(model, groups, seed=3, fractional=fractional)
    ids = _ids()
    with apply_masks(model, values, groups=groups):
        expected = model_output(model, ids)
    fused = copy.deepcopy(model)
    fuse_stream_masks(fused, values)
    assert_scaled_close(model_output(fused, ids), expected)
    binary = values.map(lambda z: (z != 0).float())
    count = stream_model_size(binary, MaskShape.from_view(ModelView(model)), **stream_count_args(model))
    assert int(count) == ModelView(fused).num_params()


@pytest.mark.parametrize("family", list(MODELS))
def test_whole_model_count_covers_every_parameter_the_masks_touch(family):
    # `fixed` is what the explicit count leaves out: nothing for llama, the untied head's bias for OPT
    # (added when its final LayerNorm's beta was folded into it).
    model = _projected(family)
    args = stream_count_args(model)
    view = ModelView(model)
    expected = 0 if view.head.bias is None else view.head.bias.numel()
    assert args["fixed"] == expected
    assert args["head_map"] == family.startswith("llama-tied")
    assert args["embedding_map"] == (family == "llama-tied-own")


def test_mask_set_with_groups_feeds_one_gate_per_group_and_trains_it():
    model = _projected("llama-untied")
    groups = stream_groups(model)
    masks = MaskSet.from_view(
        ModelView(model), head=False, layer=False, intermediate=False, hidden="per_group", groups=groups, seed=0
    )
    values = masks.keep_probs()
    assert values.mha_in[0] is values.ffn_out[1] and values.mha_in[2] is not values.mha_in[1]
    masks.train()
    with apply_masks(model, masks):
        loss = model(_ids()).logits.square().mean()
    loss.backward()
    assert all(gate.log_alpha.grad is not None for gate in masks.group_hidden)


def test_binarized_masks_meet_a_whole_model_target():
    model = _projected("llama-tied")
    groups = stream_groups(model)
    shape = MaskShape.from_view(ModelView(model))
    masks = MaskSet(shape, head=False, layer=False, intermediate=False, hidden="per_group", groups=groups, seed=1)
    total = ModelView(model).num_params()
    args = stream_count_args(model)

    # binarize() counts Eq. 30; the stage passes the whole-model count through `total` and a residual
    # of 'none'; here the whole-model count is checked on its own thresholded masks instead.
    scores = masks.scores()
    result = binarize(scores, shape, 0.2, residual="none")
    fused = copy.deepcopy(model)
    fuse_stream_masks(fused, result.masks)
    assert int(stream_model_size(result.masks, shape, **args)) == ModelView(fused).num_params()
    assert ModelView(fused).num_params() < total


def test_bad_inputs_raise_one_line_errors():
    model = _projected("llama-untied")
    with pytest.raises(SlimkitError, match="layer groups"):
        slice_stream(model, [torch.arange(4)])
    with pytest.raises(SlimkitError, match="at least one"):
        slice_stream(model, [torch.arange(0), torch.arange(3)])
    with pytest.raises(SlimkitError, match="per_group needs"):
        MaskSet.from_view(ModelView(model), hidden="per_group", intermediate=False)
    with pytest.raises(SlimkitError, match="consecutive"):
        MaskSet.from_view(ModelView(model), hidden="per_group", groups=[[0, 2], [1, 3]], intermediate=False)


@pytest.mark.parametrize("tied_head", ["joint", "own"])
def test_mask_training_meets_the_target_and_the_run_reloads(tmp_path, tiny_llama_dir, tied_head):
    from slimkit.recipes.loading import load_recipe
    from tests.recipes.test_recipes import tiny_recipe

    bundled, _ = load_recipe("sp3-llm")
    stages = [s.model_dump() for s in bundled.stages]
    stages[0]["args"].update(group_size=2, tied_head=tied_head)
    stages[1]["args"].update(mask_steps=4, warmup_steps=2, batch_size=2, seq_len=16)
    raw = tiny_recipe(
        tiny_llama_dir,
        name="tiny-sp3-llm",
        target={"ratio": 0.3, "of": "model", "tolerance": 0.025},  # one tiny hidden gate is ~2%
        calibration={"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2},
        stages=stages,
        eval={"perplexity": None},
    )
    report = slimkit.run(raw, tmp_path / "run", evaluate=False).report.as_json()
    stage = report["stages"]["mask_train"]
    assert stage["steps"] == 4 and len(stage["history"]["expected_sparsity"]) == 4
    assert stage["binary_sparsity"] >= 0.3
    assert stage["params"] == report["params"]["after"]
    assert report["target"]["achieved"] >= 0.3
    model, tokenizer = slimkit.load(tmp_path / "run" / "model")
    assert ModelView(model).num_params() == stage["params"]
    ids = tokenizer("hello there", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
    assert ("basis_change" in ModelView(model).embed_tokens._modules) == (tied_head == "own")


def test_rank_prior_starts_the_gates_in_principal_component_order():
    from slimkit.primitives.masks.mask_set import apply_rank_prior

    model = _projected("llama-untied")
    masks = MaskSet.from_view(
        ModelView(model),
        head=False,
        layer=False,
        intermediate=False,
        hidden="per_group",
        groups=stream_groups(model),
        seed=0,
        init_std=0.0,
    )
    before = masks.group_hidden[0].log_alpha.detach().clone()
    apply_rank_prior(masks, 4.0)
    after = masks.group_hidden[0].log_alpha.detach()
    assert float(after[0] - before[0]) == pytest.approx(2.0) and float(after[-1] - before[-1]) == pytest.approx(-2.0)
    assert bool((after[1:] < after[:-1]).all())  # the first principal component is the most likely kept


def test_mask_training_with_distillation_runs_and_fuses():
    from slimkit.primitives.masks.mask_settings import StreamMaskSettings
    from slimkit.primitives.masks.stream import train_stream_masks
    from slimkit.primitives.masks.training import MaskTarget

    model = _projected("llama-untied")
    total = ModelView(model).num_params()
    settings = StreamMaskSettings(mask_steps=2, warmup_steps=1, distill=0.5)
    report = train_stream_masks(model, [_ids(7), _ids(8)], settings, MaskTarget(0.2, total))
    assert len(report["history"]["loss"]) == 2 and report["params"] == ModelView(model).num_params()
    # the distillation term is added to the task loss (the Lagrangian starts at zero)
    assert report["history"]["loss"][0] > report["history"]["task_loss"][0]
    assert report["achieved_sparsity"] >= 0.2


def test_own_embedding_basis_at_full_width_is_exact_and_sliced_in_its_own_coordinates():
    # tied_head="own" re-represents the tied embedding in its own basis at full width (lossless), and slicing keeps
    # its top |S_1| components (not group 1's kept coordinates): the embedding and its map shrink together
    model = MODELS["llama-tied-own"]()
    with torch.no_grad():
        ModelView(model).embed_tokens.weight.mul_(50.0)
    ids = _ids()
    expected = model_output(model.eval(), ids)
    settings = ProjectionSettings(group_size=2, ratio=0.0, tied_head="own")
    report = project_hidden_dimension(model, [_ids(seed) for seed in (5, 6)], settings)
    assert "basis_change" in ModelView(model).embed_tokens._modules, report
    assert_scaled_close(model_output(model, ids), expected)
    view = ModelView(model)
    groups = stream_groups(model)
    d = view.hidden_size
    keep = [torch.arange(0, d, 2), torch.arange(1, d, 3)]
    slice_stream(model, keep)
    assert view.embed_tokens.weight.shape[1] == keep[0].numel()
    embedding_map = view.embed_tokens._modules["basis_change"].weight
    assert tuple(embedding_map.shape) == (keep[0].numel(), keep[0].numel())
    assert tuple(view.final_norm.module._modules["basis_change"].weight.shape) == (keep[0].numel(), keep[1].numel())
    assert len(groups) == 2 and torch.isfinite(model_output(model, ids)).all()


@pytest.mark.parametrize("kept_value", ["one", "trained"])
def test_kept_value_one_keeps_the_kept_filters_unscaled(kept_value):
    # Weights frozen (learning_rate 0): with kept_value one every fused down_proj column is an original column
    # exactly; with the trained values (below 1 after the masks move) the kept columns are scaled.
    from slimkit.primitives.masks.mask_settings import StreamMaskSettings
    from slimkit.primitives.masks.stream import train_stream_masks
    from slimkit.primitives.masks.training import MaskTarget

    model = _projected("llama-untied")
    view = ModelView(model)
    before = [layer.linear("down").weight.detach().clone() for layer in view.layers]
    total = view.num_params()
    settings = StreamMaskSettings(hidden=False, mask_steps=3, learning_rate=0.0, kept_value=kept_value)
    report = train_stream_masks(model, [_ids(7), _ids(8)], settings, MaskTarget(0.2, total))
    assert report["achieved_sparsity"] >= 0.2
    exact = []
    for layer, original in zip(ModelView(model).layers, before, strict=True):
        fused = layer.linear("down").weight.detach()
        matches = (fused.T[:, None, :] == original.T[None, :, :]).all(-1).any(-1)  # each fused column an original
        exact.append(bool(matches.all()))
    assert all(exact) if kept_value == "one" else not any(exact)


def test_masks_only_training_computes_no_weight_gradient_and_fuses_the_same_model(monkeypatch):
    # learning_rate 0: the weights stop requiring gradients for the run (restored after) and the fine-tuning step,
    # with nothing to train, runs no backward; the fused model and the history equal those of the former path,
    # which computed the weights' gradients and discarded them
    import contextlib

    from slimkit.primitives.masks import training
    from slimkit.primitives.masks.mask_settings import StreamMaskSettings
    from slimkit.primitives.masks.stream import train_stream_masks
    from slimkit.primitives.masks.training import MaskTarget

    settings = StreamMaskSettings(finetune_steps=1, mask_steps=3, warmup_steps=1, learning_rate=0.0)
    backward = training.checked_backward
    start = _projected("llama-untied")
    results = {}
    for frozen in (True, False):
        if not frozen:
            monkeypatch.setattr(training, "frozen_weights", lambda _model, _frozen: contextlib.nullcontext())
        model = copy.deepcopy(start)
        weights_require_grad: list[bool] = []

        def recorded(*args, model=model, seen=weights_require_grad):
            seen.append(any(p.requires_grad for p in model.parameters()))
            return backward(*args)

        monkeypatch.setattr(training, "checked_backward", recorded)
        total = ModelView(model).num_params()
        report = train_stream_masks(model, [_ids(7), _ids(8)], settings, MaskTarget(0.2, total))
        assert all(p.requires_grad for p in model.parameters())
        results[frozen] = (model.state_dict(), report["history"], weights_require_grad)
    state, history, seen = results[True]
    old_state, old_history, old_seen = results[False]
    assert seen == [False] * 3 and old_seen == [True] * 4  # the fine-tuning step ran a backward before
    assert history == old_history and state.keys() == old_state.keys()
    assert all(torch.equal(state[k], old_state[k]) for k in state)
