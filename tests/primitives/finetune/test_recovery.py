"""The token-budgeted recovery loop on a tiny model: exactly the budget trained, kill-and-resume equals the
uninterrupted run bit for bit, gradient accumulation equals the whole batch, a divergence keeps the last good weights,
and distillation trains through the same loop."""

from __future__ import annotations

import math

import pytest
import torch

from slimkit.primitives.finetune import LoraConfig
from slimkit.primitives.finetune.recovery import DistillationObjective, LanguageModelObjective, RecoveryConfig
from slimkit.primitives.finetune.token_recovery import recover_in_tokens
from slimkit.primitives.finetune.token_stream import TextSource
from tests.tiny import tiny_llama

LORA = LoraConfig(rank=4, dropout=0.1, learning_rate=5e-3)
SOURCE = TextSource("alpaca", seed=0)


def _run(tokenizer, recovery, checkpoint=None, progress=None, objective=None, lora=LORA):
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    objective = objective or LanguageModelObjective()
    return recover_in_tokens(model, tokenizer, lora, recovery, SOURCE, objective, checkpoint, progress)


def _config(**changes):
    values = dict(tokens=6 * 2 * 24 - 5, batch_size=2, seq_len=24, learning_rate=5e-3, validation_windows=2)
    return RecoveryConfig(**{**values, **changes})


def test_exactly_the_budget_is_trained_and_the_loss_falls(tokenizer):
    seen = []
    _model, report = _run(tokenizer, _config(validate_every=2), progress=lambda s, t, _r: seen.append((s, t)))
    assert report["tokens"] == 6 * 2 * 24 - 5 == sum(t for _s, t in seen) and report["steps"] == 6
    assert seen[-1] == (6, 24 + 19)  # the last step: two windows, 19 of the second one's 24 tokens counted
    assert [v["step"] for v in report["validation"]] == [0, 2, 4, 6] and report["stopped"] is None
    assert report["validation"][-1]["loss"] < report["validation"][0]["loss"]


def test_kill_and_resume_equals_the_uninterrupted_run(tokenizer, tmp_path):
    config = _config(checkpoint_every=2, validate_every=3)
    whole, whole_report = _run(tokenizer, config)

    def killed(step, _tokens, _result):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tokenizer, config, tmp_path / "ckpt", progress=killed)
    assert (tmp_path / "ckpt" / "state.pt").is_file()
    resumed, resumed_report = _run(tokenizer, config, tmp_path / "ckpt")
    assert resumed_report["resumed_from_step"] == 4
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed_report["losses"] == whole_report["losses"]
    assert resumed_report["validation"] == whole_report["validation"]
    assert resumed_report["tokens"] == whole_report["tokens"]


def test_gradient_accumulation_equals_the_whole_batch(tokenizer):
    lora = LoraConfig(rank=4, dropout=0.0)
    whole, _ = _run(tokenizer, _config(), lora=lora)
    split, _ = _run(tokenizer, _config(micro_batch_size=1), lora=lora)
    for a, b in zip(whole.state_dict().values(), split.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_divergence_stops_and_keeps_the_last_good_weights(tokenizer):
    model, report = _run(tokenizer, _config(learning_rate=1e30, max_grad_norm=None))
    assert report["stopped"].startswith("diverged at step ")
    assert "kept the weights after step" in report["stopped"]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert math.isfinite(report["losses"][0])


def test_distillation_through_the_same_loop(tokenizer):
    torch.manual_seed(1)
    teacher = tiny_llama(vocab_size=len(tokenizer))
    objective = DistillationObjective(teacher, temperature=2.0)
    _model, report = _run(tokenizer, _config(validate_every=3), objective=objective)
    assert report["steps"] == 6 and report["validation"][-1]["loss"] < report["validation"][0]["loss"]


def test_bfloat16_autocast_trains_close_to_float32(tokenizer):
    lora = LoraConfig(rank=4, dropout=0.0)
    _plain, plain = _run(tokenizer, _config(), lora=lora)
    _cast, cast = _run(tokenizer, _config(autocast=True), lora=lora)
    assert cast["losses"] != plain["losses"]  # the forward really ran in bfloat16
    for a, b in zip(cast["losses"], plain["losses"], strict=True):
        assert abs(a - b) < 0.05 * abs(b)
