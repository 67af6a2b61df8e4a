"""Which checkpoint a recovery run can resume from (:func:`resume_problem`, checked by hand on small dicts), and the
replicated checkpoint written atomically and read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.checkpoint import (
    SHARDED_KEY,
    STATE_FILE,
    load_checkpoint,
    resume_problem,
    save_checkpoint,
    shapes_of,
)

FOLDER = Path("ckpt")
SHAPES = {"a.weight": (4, 3), "b.weight": (2,)}


def test_shapes_of_names_each_tensor_whole_shape():
    assert shapes_of({"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(2)}) == SHAPES


def test_a_checkpoint_of_the_same_tensors_resumes():
    replicated = {"trained": {"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(2)}}
    assert resume_problem(FOLDER, replicated, SHAPES, sharded=False) is None
    sharded = {SHARDED_KEY: {"b.weight": [2], "a.weight": (4, 3)}}  # saved shapes may come back as lists
    assert resume_problem(FOLDER, sharded, SHAPES, sharded=True) is None


def test_other_shapes_or_names_are_refused_in_one_line_naming_the_first():
    wider = {SHARDED_KEY: {"a.weight": (5, 3), "b.weight": (2,)}}
    problem = resume_problem(FOLDER, wider, SHAPES, sharded=True)
    assert problem == (
        "the recovery checkpoint ckpt holds other trained tensors than this run (1 differ; a.weight: saved [5, 3], "
        "this run [4, 3]); delete ckpt to start the recovery over"
    )
    renamed = {"trained": {"a.weight": torch.zeros(4, 3), "c.weight": torch.zeros(2)}}
    problem = resume_problem(FOLDER, renamed, SHAPES, sharded=False)
    assert problem is not None and "(2 differ; b.weight: saved none, this run [2])" in problem


def test_a_gathered_checkpoint_is_refused_by_a_sharded_run_and_the_reverse():
    gathered = {"trained": {"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(2)}, "optimizer": {}}
    problem = resume_problem(FOLDER, gathered, SHAPES, sharded=True)
    assert problem is not None and problem.startswith("the recovery checkpoint ckpt holds gathered weights")
    assert problem.endswith("delete ckpt to start the recovery over") and "\n" not in problem
    problem = resume_problem(FOLDER, {SHARDED_KEY: dict(SHAPES)}, SHAPES, sharded=False)
    assert problem is not None and "is a sharded run's, and this run is not sharded" in problem


def test_a_replicated_checkpoint_is_swapped_in_whole_and_read_back(tmp_path):
    folder = tmp_path / "ckpt"
    save_checkpoint(folder, {"step": 1, "trained": {"a.weight": torch.ones(2)}})
    save_checkpoint(folder, {"step": 2, "trained": {"a.weight": torch.full((2,), 2.0)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging or replaced sibling left
    state = load_checkpoint(folder)
    assert state is not None and state["step"] == 2 and torch.equal(state["trained"]["a.weight"], torch.full((2,), 2.0))
    assert load_checkpoint(tmp_path / "none") is None


def test_an_unreadable_checkpoint_is_one_line(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / STATE_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(SlimkitError, match=r"^cannot read the recovery checkpoint .*; delete .* over$"):
        load_checkpoint(folder)
