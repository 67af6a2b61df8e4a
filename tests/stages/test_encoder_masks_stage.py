"""``mask_train_encoder``'s refusals: mask levels a model cannot take and a step budget of zero, one line before
any compute (the stage's ``check_model`` and its settings' validation), and its memory plan."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.heads import slice_heads
from slimkit.stages.encoder_masks import MaskTrainEncoderArgs
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.tiny import byte_tokenizer, tiny_bert, tiny_llama, tiny_qwen3


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        (tiny_llama, "llama rotates q and k by position"),
        (tiny_qwen3, "qwen3 rotates q and k by position"),
    ],
)
def test_intermediate_masks_are_refused_on_models_that_cannot_take_them(model, fragment):
    args = MaskTrainEncoderArgs(intermediate=True)
    with pytest.raises(SlimkitError, match="mask_train_encoder: intermediate: true") as error:
        args.check_model(model())
    assert fragment in str(error.value) and "set intermediate: false" in str(error.value)


def test_layer_masks_are_refused_on_a_model_without_them():
    with pytest.raises(SlimkitError, match=r"mask_train_encoder: layer: true .* no blocks to mask in this llama model"):
        MaskTrainEncoderArgs(layer=True).check_model(tiny_llama())
    with pytest.raises(SlimkitError, match="mask_train_encoder: needs a post-norm encoder"):
        MaskTrainEncoderArgs(layer=False).check_model(tiny_llama())


def test_an_encoder_takes_every_level():
    MaskTrainEncoderArgs(intermediate=True, layer=True, head=True).check_model(tiny_bert())
    assert MaskTrainEncoderArgs(intermediate=True).needs_calibration()
    assert not MaskTrainEncoderArgs().needs_calibration()


@pytest.fixture
def model_dirs(tmp_path):
    tokenizer = byte_tokenizer()
    folders = {}
    for name, build in (("llama", tiny_llama), ("bert", tiny_bert)):
        folders[name] = tmp_path / name
        build(vocab_size=len(tokenizer)).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


@pytest.mark.parametrize(
    ("model", "changes", "fragment"),
    [
        ("llama", ["stages.2.args.intermediate=true"], "GLUE tasks need an encoder model"),
        (
            "bert",
            ["stages.2.args.dimension_steps=0", "stages.2.args.joint_steps=0"],
            "stages.2: args: dimension_steps + joint_steps must be >= 1",
        ),
        (
            "bert",
            ["stages.2.args.joint_steps=0"],
            "stages.2: args: joint_steps: 0 leaves the head and layer gates untrained",
        ),
        (
            "bert",
            ["stages.2.args.hidden=shared", "stages.2.args.rank_prior=4"],
            "stages.2: args: rank_prior: 4 orders gates by principal-component rank, which needs hidden: per_norm",
        ),
    ],
)
def test_cli_refuses_in_one_line(monkeypatch, capsys, tmp_path, model_dirs, model, changes, fragment):
    out = tmp_path / "out"
    sets = [part for change in changes for part in ("--set", change)]
    args = ["recipe", "run", "sp3-bert", "--model", str(model_dirs[model]), *sets, "--out", str(out)]
    code, _out, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, fragment)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(model_dirs)


def test_masks_are_not_trained_again_on_heads_of_their_own_widths():
    model = tiny_bert()
    slice_heads(model, 1, [torch.tensor([0, 1])] * 4, [torch.tensor([3])] * 4)
    with pytest.raises(SlimkitError, match=r"mask_train_encoder: needs heads of one width; layer\(s\) 1 already"):
        MaskTrainEncoderArgs(hidden="shared").check_model(model)


def test_the_memory_plan_counts_the_weights_training_when_they_train():
    """``mask_train_encoder`` and ``glue_finetune`` plan the backward through the task model and, when the weights
    train, their AdamW state. Hand-checkable float32 shape: one layer of hidden 4, MLP 8, 2 heads of 2, vocab 10 (212
    parameters); a layer saves per token 6 x 4 + 2 x 4 + 2 x 4 + 4 x 8 = 72 values and 2 x 4 float32 norms (320 B)."""
    from slimkit.engine.stage_memory import MemoryInputs
    from slimkit.primitives.device.memory_model import ModelShape
    from slimkit.stages.glue_finetune import GlueFinetuneArgs

    shape = ModelShape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=2, head_dim=2, vocab=10, tied=True)
    params = shape.total_params()
    assert params == 4 * (2 * 4 + 2 * 4) + 3 * 4 * 8 + 2 * 4 + 10 * 4 + 4 == 212
    inputs = MemoryInputs(shape, None, 4)
    masks_only = MaskTrainEncoderArgs(learning_rate=0.0, batch_size=2, max_length=8).memory("m", inputs)
    assert masks_only.parts == {"activations": 2 * 8 * 320}
    trained = MaskTrainEncoderArgs(learning_rate=2e-5, batch_size=2, max_length=8).memory("m", inputs)
    # float32 weights: their gradients and AdamW's two moments (no separate masters)
    assert trained.parts == {"activations": 5120, "weight gradients": 212 * 4, "AdamW moments": 2 * 212 * 4}
    assert "learning_rate: 0" in trained.advice
    finetune = GlueFinetuneArgs(batch_size=2, max_length=8).memory("g", inputs)
    assert finetune.parts == trained.parts
    assert GlueFinetuneArgs(max_steps=0).memory("g", inputs).parts == {}
