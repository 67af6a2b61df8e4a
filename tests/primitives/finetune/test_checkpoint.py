"""Which checkpoint a recovery run can resume from (:func:`resume_problem`, checked by hand on small dicts); the
replicated and the sharded checkpoint written atomically and read back (the sharded one in a process group of one),
a failed write keeping the previous checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slimkit.primitives.finetune.checkpoint as checkpoint_module
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.checkpoint import (
    CHECKPOINT_MARKER,
    ROOT_MARKER,
    SHARDED_KEY,
    SHARDS_DIR,
    STATE_FILE,
    load_checkpoint,
    load_sharded,
    model_content_key,
    remove_checkpoint_root,
    resume_problem,
    save_checkpoint,
    save_sharded_checkpoint,
    shapes_of,
    tensors_digest,
)
from tests.contracts.hostile import tree_checksum
from tests.mounting import bind_mount

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


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_checkpoint_is_swapped_in_whole_and_a_failed_write_keeps_the_previous(
    tmp_path, one_process_group, monkeypatch
):
    folder = tmp_path / "ckpt"
    save_sharded_checkpoint(folder, {"step": 1}, {"model": {"w": torch.arange(6.0)}})
    assert (folder / SHARDS_DIR / "__0_0.distcp").is_file() and (folder / SHARDS_DIR / ".metadata").is_file()
    save_sharded_checkpoint(folder, {"step": 2}, {"model": {"w": torch.arange(6.0) * 2}})

    def fail(*_args, **_kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patched:  # a shard cannot be written: every process's write fails
        patched.setattr(torch, "save", fail)
        with pytest.raises(SlimkitError, match=r"^cannot write the recovery checkpoint .* \(OSError: disk full\)$"):
            save_sharded_checkpoint(folder, {"step": 3}, {"model": {"w": torch.arange(6.0) * 3}})
    with monkeypatch.context() as patched:  # the main process cannot swap the folder in
        patched.setattr(checkpoint_module, "swap_in", fail)
        with pytest.raises(SlimkitError, match=r"^cannot write the recovery checkpoint .* \(OSError: disk full\)$"):
            save_sharded_checkpoint(folder, {"step": 3}, {"model": {"w": torch.arange(6.0) * 3}})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "init") == ["ckpt"]  # no staging left
    state = load_checkpoint(folder)
    assert state == {"step": 2}
    shards = {"model": {"w": torch.zeros(6)}}
    load_sharded(folder, shards)
    assert torch.equal(shards["model"]["w"], torch.arange(6.0) * 2)
    (folder / SHARDS_DIR / "__0_0.distcp").unlink()  # a shard lost: one line naming the folder to delete
    with pytest.raises(SlimkitError, match=r"^cannot read the recovery checkpoint .*; delete .* over$"):
        load_sharded(folder, shards)


def test_a_checkpoint_is_marked_and_only_what_its_marker_lists_is_deleted(tmp_path):
    folder = tmp_path / "root" / "distill-1"
    save_checkpoint(folder, {"step": 1, "trained": {"a.weight": torch.ones(2)}})
    assert sorted(p.name for p in folder.iterdir()) == sorted([CHECKPOINT_MARKER, STATE_FILE])
    assert (folder.parent / ROOT_MARKER).is_file()  # the folder of checkpoints slimkit created is marked too
    (folder / "mine.txt").write_text("a user's file put inside")
    save_checkpoint(folder, {"step": 2, "trained": {"a.weight": torch.ones(2)}})
    kept = [p for p in folder.parent.iterdir() if ".replaced-" in p.name]  # the previous folder, less its listing
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["mine.txt"]
    lines = remove_checkpoint_root(folder.parent)
    assert len(lines) == 1 and "mine.txt (not written by slimkit)" in lines[0]
    assert (kept[0] / "mine.txt").read_text() == "a user's file put inside" and not folder.exists()


def test_a_folder_of_checkpoints_slimkit_did_not_create_is_kept(tmp_path):
    root = tmp_path / ".out.checkpoints"
    (root / "thesis").mkdir(parents=True)
    (root / "thesis" / "chapter1.tex").write_text("years of work")
    before = tree_checksum(tmp_path)
    lines = remove_checkpoint_root(root)
    assert lines == [
        f"kept {root}: slimkit did not create it (no {ROOT_MARKER}); delete it yourself if it is not needed"
    ]
    assert tree_checksum(tmp_path) == before


def test_a_marked_folder_of_checkpoints_goes_whole(tmp_path):
    root = tmp_path / ".out.checkpoints"
    save_checkpoint(root / "lora-1", {"step": 1, "trained": {"a.weight": torch.ones(2)}})
    save_checkpoint(root / "distill-2", {"step": 1, "trained": {"a.weight": torch.ones(2)}})
    assert remove_checkpoint_root(root) == [] and not root.exists()


def _mounts_under(folder: Path) -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line.split()[4] for line in lines if line.split()[4].startswith(str(folder))]


def test_replacing_a_checkpoint_never_deletes_across_a_bind_mount(tmp_path):
    users = tmp_path / "users"
    (users / "thesis").mkdir(parents=True)
    (users / "thesis" / "chapter1.tex").write_text("years of work")
    folder = tmp_path / "root" / "distill-1"
    save_checkpoint(folder, {"step": 1, "trained": {"a.weight": torch.ones(2)}})
    before = tree_checksum(users)
    try:
        with bind_mount(users, folder / "shards"):
            save_checkpoint(folder, {"step": 2, "trained": {"a.weight": torch.ones(2)}})  # the mount moves aside
            assert tree_checksum(users) == before
            (line,) = remove_checkpoint_root(folder.parent)
            assert "shards (a mount point)" in line and tree_checksum(users) == before
    finally:  # the mount point moved with the previous checkpoint: unmount it where it is now
        for target in _mounts_under(tmp_path):
            subprocess.run(["umount", "-l", target], capture_output=True)
    assert not _mounts_under(tmp_path)


def test_a_checkpoint_is_keyed_by_the_input_models_content(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * (3 << 20))
    key = model_content_key(folder, torch.nn.Linear(1, 1))
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[3 << 19] = ord("x")  # one byte in the middle
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert model_content_key(folder, torch.nn.Linear(1, 1)) != key


def test_a_model_in_memory_is_keyed_by_its_weights():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    key = model_content_key(None, model)
    assert model_content_key(None, model) == key
    with torch.no_grad():
        model.weight[1, 2] += 1
    assert model_content_key(None, model) != key
    assert tensors_digest([("a", torch.ones(2))]) != tensors_digest([("a", torch.ones(2, dtype=torch.float64))])
    assert tensors_digest([("a", torch.ones(2))]) != tensors_digest([("b", torch.ones(2))])
