"""``lora`` and ``distill`` with a token budget, end to end on a tiny model: the budget in the report, the loss
curves' plot in the output folder, a run killed mid-training resumes from its checkpoint to the uninterrupted run's
weights, and the token-only settings refused without ``tokens``."""

from __future__ import annotations

import pytest
import torch

import slimkit
from slimkit.engine.output_safety import checkpoint_root
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import validate
from slimkit.stages import recovery_settings
from tests.recipes.test_recipes import tiny_recipe

TOKENS = 5 * 2 * 32 - 9
ARGS = {"tokens": TOKENS, "batch_size": 2, "seq_len": 32, "validation_windows": 2, "learning_rate": 5e-3}


def _recipe(model_dir, stage="lora", **args):
    stages = [{"stage": stage, "args": {**ARGS, **args}}]
    return tiny_recipe(model_dir, target={"ratio": 0}, stages=stages)


@pytest.mark.parametrize("stage", ["lora", "distill"])
def test_a_token_budget_run_reports_the_budget_and_plots_the_curves(tmp_path, tiny_llama_dir, stage):
    out = tmp_path / "run"
    result = slimkit.run(_recipe(tiny_llama_dir, stage, validate_every=2), out, evaluate=False, compare_dense=False)
    details = result.report.as_json()["stages"][stage]
    assert details["tokens"] == TOKENS == details["budget_tokens"] and details["steps"] == 5
    assert [v["step"] for v in details["validation"]] == [0, 2, 4, 5] and details["stopped"] is None
    assert (out / f"{stage}-curves" / "loss.png").stat().st_size > 0
    assert not checkpoint_root(out).exists()  # published: the checkpoints are gone


def test_a_killed_recipe_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_llama_dir, monkeypatch):
    raw = _recipe(tiny_llama_dir, checkpoint_every=2)
    whole = slimkit.run(raw, tmp_path / "whole", evaluate=False, compare_dense=False).model.state_dict()
    original = recovery_settings.recover_in_tokens

    def killed_at_step_3(*args, **kwargs):
        def progress(step, tokens, result):
            if step == 3:
                raise KeyboardInterrupt

        return original(*args[:7], progress, *args[8:], **kwargs)

    monkeypatch.setattr(recovery_settings, "recover_in_tokens", killed_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        slimkit.run(raw, out, evaluate=False, compare_dense=False)
    assert not out.exists() and any(checkpoint_root(out).iterdir())
    monkeypatch.setattr(recovery_settings, "recover_in_tokens", original)
    result = slimkit.run(raw, out, evaluate=False, compare_dense=False)
    assert result.report.as_json()["stages"]["lora"]["resumed_from_step"] == 2
    for name, tensor in result.model.state_dict().items():
        assert torch.equal(tensor, whole[name]), name


def test_a_diverging_run_stops_with_one_note_and_saves_the_last_good_weights(tmp_path, tiny_llama_dir, monkeypatch):
    # the loss turns infinite from the third training batch on (learning rates are bounded, so none diverges here)
    from slimkit.primitives.finetune.recovery import LanguageModelObjective

    honest = LanguageModelObjective.loss_sum
    calls = {"n": 0}

    def diverging(self, model, ids, mask):
        calls["n"] += 1
        loss = honest(self, model, ids, mask)
        return loss * float("inf") if calls["n"] > 2 and model.training else loss

    monkeypatch.setattr(LanguageModelObjective, "loss_sum", diverging)
    raw = _recipe(tiny_llama_dir, max_grad_norm=None)
    result = slimkit.run(raw, tmp_path / "run", evaluate=False, compare_dense=False)
    report = result.report.as_json()
    stopped = report["stages"]["lora"]["stopped"]
    assert stopped.startswith("diverged at step ") and report["stages"]["lora"]["tokens"] < TOKENS
    assert [n for n in report["notes"] if n.startswith("lora stopped early: diverged at step ")]
    assert all(bool(torch.isfinite(p).all()) for p in result.model.parameters())


def test_offline_top_k_teacher_is_computed_once_and_reused(tmp_path, tiny_llama_dir):
    raw = _recipe(tiny_llama_dir, "distill", top_k=16)
    first = slimkit.run(raw, tmp_path / "first", evaluate=False, compare_dense=False).report.as_json()
    second = slimkit.run(raw, tmp_path / "second", evaluate=False, compare_dense=False)
    one, two = first["stages"]["distill"], second.report.as_json()["stages"]["distill"]
    assert one["windows_computed"] > 0 and one["teacher_load_seconds"] > 0
    assert two["windows_computed"] == 0 and two["teacher_load_seconds"] == 0.0
    reads = one["windows_computed"] + one["cached_windows_read"]  # the validation windows are read twice
    assert two["cached_windows_read"] == reads and two["losses"] == one["losses"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"tokens": None, "top_k": 8}, "top_k: only with tokens"),
        ({"tokens": None, "checkpoint_every": 2}, "checkpoint_every: only with tokens"),
        ({"steps": 3}, "steps and tokens: give one of them"),
        ({"data_folder": "/nonexistent/folder"}, "is not a folder"),
    ],
)
def test_token_settings_are_refused_in_one_line(tmp_path, args, message):
    raw = _recipe(tmp_path, "distill" if "top_k" in args else "lora", **args)
    if args.get("tokens", 1) is None:
        raw["stages"][0]["args"].pop("tokens")
        raw["stages"][0]["args"].pop("validation_windows")
    with pytest.raises(SlimkitError, match=message):
        validate(raw, "r.yaml")
