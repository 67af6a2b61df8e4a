"""``mask_train_encoder``'s refusals: mask levels a model cannot take and a step budget of zero, one line before
any compute (the stage's ``check_model`` and its settings' validation)."""

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
