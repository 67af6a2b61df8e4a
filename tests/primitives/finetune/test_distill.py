"""Distillation recovery: the KL and hidden-state terms by hand, the loss hook of train_lora, and the ``distill``
stage end to end on a tiny llama (the KL to the dense teacher falls with steps; the merged model saves and loads)."""

from __future__ import annotations

import math

import pytest
import torch

import slimkit
from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune import LoraConfig, train_lora
from slimkit.primitives.finetune.distill import DistillConfig, distill_loss, hidden_mse
from slimkit.primitives.finetune.lora import lm_loss
from slimkit.recipes.loading import validate
from tests.tiny import tiny_llama

FAST = {"batch_size": 2, "seq_len": 32, "dataset": "alpaca"}
STAGE = {"rank": 4, "learning_rate": 3e-4, "dropout": 0.0, "batch_size": 4, "seq_len": 64, "dataset": "alpaca"}

# Two tokens over a 3-word vocabulary: the teacher is uniform on both; the student is (1/2, 1/4, 1/4) on the
# first and uniform on the second.
TEACHER = torch.zeros(1, 2, 3)
STUDENT = torch.tensor([[[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.0, 0.0]]])


def test_distill_loss_is_zero_for_equal_logits():
    logits = torch.randn(2, 5, 7)
    assert distill_loss(logits, logits.clone(), temperature=1.0).item() == pytest.approx(0.0, abs=1e-6)
    assert distill_loss(logits, logits.clone(), temperature=3.0).item() == pytest.approx(0.0, abs=1e-6)


def test_distill_loss_by_hand():
    # Token 1: KL(u || s) = 1/3 [ln((1/3)/(1/2)) + 2 ln((1/3)/(1/4))] = ln(32/27) / 3; token 2: 0. Mean: ln(32/27) / 6.
    assert distill_loss(STUDENT, TEACHER).item() == pytest.approx(math.log(32 / 27) / 6, rel=1e-5)
    # The mask keeps token 1 only: the mean is over one token.
    mask = torch.tensor([[1, 0]])
    assert distill_loss(STUDENT, TEACHER, mask=mask).item() == pytest.approx(math.log(32 / 27) / 3, rel=1e-5)
    # T = 2: the student's softened probabilities are proportional to sqrt(1/2), 1/2, 1/2; the KL is times T^2 = 4.
    soft = torch.tensor([math.sqrt(0.5), 0.5, 0.5])
    soft = soft / soft.sum()
    kl = sum(1 / 3 * math.log((1 / 3) / float(p)) for p in soft)
    assert distill_loss(STUDENT, TEACHER, temperature=2.0).item() == pytest.approx(4 * kl / 2, rel=1e-5)


def test_distill_loss_is_forward_kl_and_refuses_bad_input():
    # KL(teacher || student), not the reverse: swapping the arguments changes the value.
    reverse = (0.5 * math.log(0.5 * 3) + 0.5 * math.log(0.25 * 3)) / 2
    assert distill_loss(TEACHER, STUDENT).item() == pytest.approx(reverse, rel=1e-5)
    with pytest.raises(SlimkitError, match="differ in shape"):
        distill_loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(SlimkitError, match="temperature must be a finite number > 0"):
        distill_loss(STUDENT, TEACHER, temperature=0.0)
    with pytest.raises(SlimkitError, match="mask selects no token"):
        distill_loss(STUDENT, TEACHER, mask=torch.zeros(1, 2))


def _saved_bytes(fn, *inputs: torch.Tensor) -> int:
    """Bytes of the storages autograd saves for the backward pass while ``fn()`` runs, those of ``inputs``
    (which exist anyway) left out; checkpointed chunks save only views of their inputs and their results."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    for tensor in inputs:
        storages.pop(tensor.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _unchunked_kl(student, teacher, temperature, mask):
    """The loss written out over every token at once (the formula before chunking)."""
    teacher_log_p = torch.log_softmax(teacher.float() / temperature, dim=-1)
    student_log_p = torch.log_softmax(student.float() / temperature, dim=-1)
    per_token = (teacher_log_p.exp() * (teacher_log_p - student_log_p)).sum(dim=-1)
    return (per_token * mask).sum() / mask.sum() * temperature**2


def test_chunked_kl_equals_the_whole_and_saves_less_for_backward():
    torch.manual_seed(0)
    student = torch.randn(2, 6, 50, requires_grad=True)
    teacher = torch.randn(2, 6, 50)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    whole = _unchunked_kl(student, teacher, 2.0, mask)
    (whole_grad,) = torch.autograd.grad(whole, student)
    for chunk in (1, 5, 7, 12):
        chunked = distill_loss(student, teacher, 2.0, mask, chunk_tokens=chunk)
        (chunked_grad,) = torch.autograd.grad(chunked, student)
        assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
        assert torch.allclose(chunked_grad, whole_grad, rtol=1e-5, atol=1e-8)
    # Unchunked, autograd keeps two float32 [tokens, vocab] tensors (log_softmax output, teacher probabilities)
    # for every token; chunked and checkpointed, views of the logits and the per-token results only.
    unchunked = _saved_bytes(lambda: _unchunked_kl(student, teacher, 2.0, mask).backward(), student, teacher)
    chunked = _saved_bytes(
        lambda: distill_loss(student, teacher, 2.0, mask, chunk_tokens=3).backward(), student, teacher
    )
    logits_bytes = student.numel() * 4
    assert unchunked >= 2 * logits_bytes
    assert chunked < logits_bytes / 10
    with pytest.raises(SlimkitError, match="chunk_tokens must be at least 1"):
        distill_loss(student, teacher, chunk_tokens=0)


def test_hidden_mse_is_normalised_per_layer():
    teacher = [torch.ones(1, 2, 4), 10 * torch.ones(1, 2, 4)]
    assert hidden_mse([t.clone() for t in teacher], teacher).item() == 0.0
    # A zero student is a relative error of 1 on every layer, whatever the layer's scale.
    assert hidden_mse([torch.zeros(1, 2, 4)] * 2, teacher).item() == pytest.approx(1.0)
    # Layer 1 off by 1 in every coordinate (4 / 4 = 1), layer 2 exact: the mean over layers is 1/2.
    student = [torch.zeros(1, 2, 4), 10 * torch.ones(1, 2, 4)]
    assert hidden_mse(student, teacher).item() == pytest.approx(0.5)
    with pytest.raises(SlimkitError, match="layer 0 hidden states differ in shape"):
        hidden_mse([torch.zeros(1, 2, 3)], [torch.zeros(1, 2, 4)])
    with pytest.raises(SlimkitError, match="same layer count"):
        hidden_mse([torch.zeros(1, 2, 4)], teacher)


def test_distill_config_refuses_bad_values():
    with pytest.raises(SlimkitError, match=r"^distill: temperature must be a finite number > 0 \(got nan\)$"):
        DistillConfig(temperature=float("nan"))
    with pytest.raises(SlimkitError, match="hidden_weight must be a finite number >= 0"):
        DistillConfig(hidden_weight=-1.0)


def test_the_default_loss_hook_is_the_lm_loss(tokenizer):
    config = LoraConfig(rank=2, steps=2, learning_rate=1e-2, **FAST)
    default = train_lora(tiny_llama(vocab_size=len(tokenizer)), tokenizer, config)
    torch.manual_seed(0)
    hooked = train_lora(tiny_llama(vocab_size=len(tokenizer)), tokenizer, config, loss_fn=lm_loss)
    assert default.report["losses"] == hooked.report["losses"]
    seen = []

    def counting(model, batch):
        seen.append(model.training)
        return lm_loss(model, batch)

    torch.manual_seed(0)
    train_lora(tiny_llama(vocab_size=len(tokenizer)), tokenizer, config, loss_fn=counting)
    assert seen == [True, True, False]  # one call per step, then the eval-mode check after the last update


@pytest.fixture
def sharp_llama_dir(tmp_path, tokenizer):
    """A tiny llama whose weights (not norms) are scaled by 5, saved with its tokenizer: the random model's
    next-token distributions are then peaked, so pruning half of each MLP moves them measurably (at the default
    scale the KL after pruning is ~1e-5 and LoRA steps are noise)."""
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(5.0)
    model.save_pretrained(tmp_path / "sharp-llama")
    tokenizer.save_pretrained(tmp_path / "sharp-llama")
    return tmp_path / "sharp-llama"


def _recipe(model_dir, steps: int, **distill) -> dict:
    return {
        "name": "prune-then-distill",
        "model": str(model_dir),
        "seed": 0,
        "calibration": {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2},
        "target": {"ratio": 0.5, "of": "mlp", "tolerance": 0.05},
        "stages": [
            {"sequential": [{"stage": "prune_layer", "args": {"groups": ["mlp_channel"], "scorer": "activation"}}]},
            {
                "stage": "distill",
                "args": {"steps": steps, **STAGE, **distill},
            },
        ],
        "eval": {"perplexity": None},
    }


def _kl_to(teacher, model, batch) -> float:
    with torch.no_grad():
        return distill_loss(model(input_ids=batch).logits, teacher(input_ids=batch).logits).item()


@pytest.mark.slow
def test_distill_stage_brings_the_pruned_model_closer_to_the_teacher(sharp_llama_dir, tokenizer, tmp_path):
    teacher, _ = slimkit.load(sharp_llama_dir)
    held_out = calibration_batches(tokenizer, CalibrationSpec("alpaca", 4, 32, seed=123))  # not the training windows
    kls = {}
    for steps in (0, 1, 3):
        out = tmp_path / f"out-{steps}"
        result = slimkit.run(validate(_recipe(sharp_llama_dir, steps), "r"), out=out, evaluate=False)
        kls[steps] = _kl_to(teacher, result.model, held_out)
        report = result.report.as_json()["stages"]["distill"]
        assert report["steps"] == steps and report["tokens"] == steps * 4 * 64
        if steps == 0:  # nothing to train: the teacher is not loaded
            assert report["teacher_load_seconds"] == 0.0 and report["kl_first"] is None
    # The KL to the dense teacher on held-out windows falls with the steps (about 0.040 -> 0.039 -> 0.038 here).
    assert kls[0] > kls[1] > kls[3] > 0
    assert report["kl_first"] == report["kls"][0] and report["kl_last"] == report["kls"][-1] and len(report["kls"]) == 3
    assert report["loss_first"] == pytest.approx(report["kl_first"])  # hidden_weight 0: the loss is the KL
    assert report["teacher"] == "dense" and report["teacher_load_seconds"] > 0 and report["temperature"] == 1.0
    assert math.isfinite(report["kl_after"])
    loaded, _ = slimkit.load(tmp_path / "out-3" / "model")
    with torch.no_grad():
        logits = result.model(input_ids=held_out).logits
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(loaded(input_ids=held_out).logits, logits)


def test_distill_stage_with_the_hidden_state_term(tiny_llama_dir):
    raw = _recipe(tiny_llama_dir, 2, hidden_weight=0.5, temperature=2.0)
    report = slimkit.run(validate(raw, "r"), evaluate=False).report.as_json()["stages"]["distill"]
    assert len(report["hiddens"]) == 2 and all(math.isfinite(h) and h > 0 for h in report["hiddens"])
    assert report["loss_first"] == pytest.approx(report["kl_first"] + 0.5 * report["hidden_first"], rel=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"temperature": 0}, r"stages\.1.*temperature.*greater than 0"),
        ({"temperature": float("nan")}, r"stages\.1.*temperature.*finite number"),
        ({"temperature": float("inf")}, r"stages\.1.*temperature.*finite number"),
        ({"hidden_weight": -0.1}, r"stages\.1.*hidden_weight.*greater than or equal to 0"),
        ({"teacher": "student"}, r"stages\.1.*teacher.*dense"),
    ],
)
def test_bad_distill_arguments_fail_validation_with_one_line(tiny_llama_dir, args, message):
    with pytest.raises(SlimkitError, match=message) as error:
        validate(_recipe(tiny_llama_dir, 1, **args), "r")
    assert "\n" not in str(error.value)


def test_an_in_memory_model_has_no_teacher_to_reload(tiny_llama_dir):
    model, tokenizer = slimkit.load(tiny_llama_dir)
    with pytest.raises(SlimkitError, match=r"^distill: teacher: dense reloads the recipe's model source") as error:
        slimkit.run(validate(_recipe(tiny_llama_dir, 1), "r"), model=model, tokenizer=tokenizer, evaluate=False)
    assert "\n" not in str(error.value)
