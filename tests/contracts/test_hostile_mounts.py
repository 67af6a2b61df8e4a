"""Hostile cases for deletions, overlaps and markers that mounts and planted files must not defeat.

Each case runs the CLI in-process on tiny random models and asserts one ``error:`` line (exit status 2) or the
kept result, and that the file tree outside the output is what it was. Mount cases bind-mount or mount a tmpfs
inside the test's folder (skipped with the reason where the kernel refuses) and unmount in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import slimkit
from slimkit.engine import runner
from slimkit.engine.output_safety import RUN_MARKER
from slimkit.primitives import export as export_module
from slimkit.primitives.export.hf_folder import EXPORT_MARKER
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.contracts.hostile import copy_model, plain_model, recipe_file, tree_checksum
from tests.mounting import bind_mount

TIME_LIMIT_S = 20.0


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    """A model, an earlier run's output of it and an earlier hf export of it (copied by each test)."""
    root = tmp_path_factory.mktemp("mount-templates")
    model = plain_model(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIMKIT_CACHE_DIR", str(root / "cache"))
        slimkit.run(str(recipe_file(root, model)), out=root / "run", evaluate=False)
        slimkit.export(model, root / "hf", format="hf")
    return {"model": model, "run": root / "run", "hf": root / "hf"}


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the output was refused")

    monkeypatch.setattr(runner, "load_source", refuse)
    monkeypatch.setattr(export_module, "load_source", refuse)


@pytest.fixture
def users(tmp_path) -> Path:
    """A folder of the user's that a mount shows inside an output."""
    folder = tmp_path / "users"
    (folder / "thesis").mkdir(parents=True)
    (folder / "thesis" / "chapter1.tex").write_text("years of work")
    (folder / "notes.txt").write_text("keep me")
    return folder


def run_args(tmp: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["recipe", "run", str(recipe_file(tmp, model)), "--model", str(model), "--out", str(out), *extra]


def refused(monkeypatch, capsys, args: list[str], fragment: str, root: Path, skip: tuple[str, ...] = ()) -> str:
    """Run ``args``; assert one ``error:`` line holding ``fragment``, exit 2, in time, nothing under ``root``
    changed (but ``skip``, relative paths checked by the caller). Returns the line."""
    before = tree_checksum(root, skip)
    start = time.monotonic()
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert time.monotonic() - start < TIME_LIMIT_S
    assert_one_line_error(code, err, fragment)
    assert tree_checksum(root, skip) == before
    return err.strip()


# -- --force never deletes through a mount, nor what the marker does not list ------------------------------


def test_run_force_refuses_an_old_output_holding_a_bind_mount(monkeypatch, capsys, tmp_path, templates, users):
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    with bind_mount(users, out / "model" / "data"):
        line = refused(
            monkeypatch, capsys, run_args(tmp_path, templates["model"], out, "--force"), "holds model/data", tmp_path
        )
        assert "a mount point" in line and "never deletes across a file-system boundary" in line
    assert (users / "thesis" / "chapter1.tex").read_text() == "years of work"


def test_run_force_refuses_a_mount_listed_in_a_forged_marker(monkeypatch, capsys, tmp_path, templates, users):
    """A marker is no licence to cross a mount: even listed, the mounted folder is not deleted."""
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    marker = json.loads((out / RUN_MARKER).read_text())
    marker["files"] += ["model/data/notes.txt", "model/data/thesis/chapter1.tex"]
    marker["folders"] += ["model/data", "model/data/thesis"]
    (out / RUN_MARKER).write_text(json.dumps(marker))
    with bind_mount(users, out / "model" / "data"):
        refused(monkeypatch, capsys, run_args(tmp_path, templates["model"], out, "--force"), "a mount point", tmp_path)
    assert (users / "notes.txt").read_text() == "keep me"


def test_run_force_refuses_a_file_the_user_saved_inside_model(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    (out / "model" / "my-notes.txt").write_text("mine")
    refused(
        monkeypatch,
        capsys,
        run_args(tmp_path, templates["model"], out, "--force"),
        "holds model/my-notes.txt, which slimkit did not write",
        tmp_path,
    )


@pytest.mark.slow
def test_run_force_replaces_an_old_output_and_deletes_only_it(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    model = copy_model(templates["model"], tmp_path)
    before = tree_checksum(tmp_path, skip=("out", "recipe.yaml"))
    code, _, err = run_cli(monkeypatch, capsys, *run_args(tmp_path, model, out, "--force", "--no-eval"))
    assert code == 0, err
    assert (out / "report.json").is_file() and (out / "model" / "model.safetensors").is_file()
    assert tree_checksum(tmp_path, skip=("out", "recipe.yaml")) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == []


def test_export_force_refuses_an_old_export_holding_a_bind_mount(monkeypatch, capsys, tmp_path, templates, users):
    out = Path(shutil.copytree(templates["hf"], tmp_path / "hf"))
    with bind_mount(users, out / "data"):
        args = ["export", str(templates["model"]), "--format", "hf", "--out", str(out), "--force"]
        refused(monkeypatch, capsys, args, "holds data, a mount point", tmp_path)
    assert (users / "notes.txt").read_text() == "keep me"


def test_export_force_refuses_a_nested_file_the_export_did_not_write(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["hf"], tmp_path / "hf"))
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("mine")
    args = ["export", str(templates["model"]), "--format", "hf", "--out", str(out), "--force"]
    refused(monkeypatch, capsys, args, "holds extra/notes.txt, which slimkit export did not write", tmp_path)


# -- an input is recognised under any alias; mount points before any compute ----------------------------


def test_run_out_through_a_bind_mounted_alias_of_its_model_is_refused(
    monkeypatch, capsys, tmp_path, templates, no_loading
):
    data = tmp_path / "data"
    data.mkdir()
    model = copy_model(templates["model"], data)
    with bind_mount(data, tmp_path / "alias") as alias:
        refused(monkeypatch, capsys, run_args(tmp_path, model, alias / "model", "--force"), "is the input", tmp_path)
        refused(monkeypatch, capsys, run_args(tmp_path, model, alias / "model" / "c"), "inside the input", tmp_path)
        refused(
            monkeypatch,
            capsys,
            run_args(tmp_path, alias / "model", data, "--force"),
            "a folder holding the input",
            tmp_path,
        )


def test_export_of_a_model_read_through_an_alias_over_itself_is_refused(
    monkeypatch, capsys, tmp_path, templates, no_loading
):
    data = tmp_path / "data"
    data.mkdir()
    model = copy_model(templates["model"], data)
    with bind_mount(data, tmp_path / "alias") as alias:
        args = ["export", str(alias / "model"), "--format", "hf", "--out", str(model), "--force"]
        refused(monkeypatch, capsys, args, "is the input", tmp_path)


def test_run_out_an_empty_same_filesystem_bind_mount_is_refused_before_loading(
    monkeypatch, capsys, tmp_path, templates, no_loading
):
    empty = tmp_path / "empty"
    empty.mkdir()
    with bind_mount(empty, tmp_path / "mounted") as mounted:
        assert not os.path.ismount(mounted)  # the same device: only the kernel's table shows it
        refused(monkeypatch, capsys, run_args(tmp_path, templates["model"], mounted), "is a mount point", tmp_path)
        args = ["export", str(templates["model"]), "--format", "hf", "--out", str(mounted)]
        refused(monkeypatch, capsys, args, "is a mount point", tmp_path)


def test_a_dead_runs_partial_folder_holding_a_mount_is_kept_and_the_run_succeeds(
    monkeypatch, capsys, tmp_path, templates, users
):
    partial = tmp_path / ".out.partial-4194304-abcd1234"  # no process has this id
    (partial / "model").mkdir(parents=True)
    with bind_mount(users, partial / "model" / "data"):
        before = tree_checksum(users)
        code, out, err = run_cli(
            monkeypatch, capsys, *run_args(tmp_path, templates["model"], tmp_path / "out", "--no-eval")
        )
        assert code == 0, err
        assert tree_checksum(users) == before
        assert f"kept {partial.name}" in out + err
    assert (tmp_path / "out" / "report.json").is_file()


# -- markers and leftover names read with bounds --------------------------------------------------------------


def test_export_force_with_a_fifo_marker_is_one_line_without_blocking(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["hf"], tmp_path / "hf"))
    (out / EXPORT_MARKER).unlink()
    os.mkfifo(out / EXPORT_MARKER)
    args = ["export", str(templates["model"]), "--format", "hf", "--out", str(out), "--force"]
    refused(monkeypatch, capsys, args, "a FIFO", tmp_path)


def test_export_force_with_a_marker_linked_to_dev_zero_is_one_line(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["hf"], tmp_path / "hf"))
    (out / EXPORT_MARKER).unlink()
    (out / EXPORT_MARKER).symlink_to("/dev/zero")
    args = ["export", str(templates["model"]), "--format", "hf", "--out", str(out), "--force"]
    refused(monkeypatch, capsys, args, "is a symbolic link", tmp_path)


def test_export_force_with_a_deeply_nested_marker_is_one_line(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["hf"], tmp_path / "hf"))
    (out / EXPORT_MARKER).write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    args = ["export", str(templates["model"]), "--format", "hf", "--out", str(out), "--force"]
    refused(monkeypatch, capsys, args, "nested more than", tmp_path)


def test_run_force_with_a_3_gb_run_marker_is_refused_by_its_size(monkeypatch, capsys, tmp_path, templates):
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    with open(out / RUN_MARKER, "r+b") as handle:
        handle.truncate(3 << 30)  # sparse: the size is checked, never read
    args = run_args(tmp_path, templates["model"], out, "--force")
    line = refused(monkeypatch, capsys, args, "a marker may hold", tmp_path, skip=(f"out/{RUN_MARKER}",))
    assert "is not a slimkit output" in line and (out / RUN_MARKER).stat().st_size == 3 << 30


def test_a_planted_leftover_with_a_20_digit_pid_is_left_alone(monkeypatch, capsys, tmp_path, templates):
    planted = tmp_path / ".out.partial-99999999999999999999-x"
    planted.mkdir()
    (planted / "theirs.txt").write_text("keep")
    before = tree_checksum(planted)
    code, _, err = run_cli(monkeypatch, capsys, *run_args(tmp_path, templates["model"], tmp_path / "out", "--no-eval"))
    assert code == 0, err
    assert (tmp_path / "out" / "report.json").is_file() and tree_checksum(planted) == before
    gguf_planted = tmp_path / ".m.gguf.partial-99999999999999999999-x"
    gguf_planted.write_text("theirs")
    code, _, err = run_cli(monkeypatch, capsys, "export", str(templates["model"]), "--out", str(tmp_path / "m.gguf"))
    assert code == 0, err
    assert gguf_planted.read_text() == "theirs"


def test_run_force_over_an_output_whose_marker_lists_top_level_names_only_says_so(
    monkeypatch, capsys, tmp_path, templates
):
    """A marker an earlier slimkit wrote cannot vouch for what is inside ``model/``: refused, with what to do."""
    out = Path(shutil.copytree(templates["run"], tmp_path / "out"))
    top = sorted(p.name for p in out.iterdir() if p.name != RUN_MARKER)
    (out / RUN_MARKER).write_text(json.dumps({"written_by": "slimkit recipe run", "files": top}))
    line = refused(
        monkeypatch,
        capsys,
        run_args(tmp_path, templates["model"], out, "--force"),
        "which slimkit did not write",
        tmp_path,
    )
    assert "holds model/" in line and "lists top-level names only; delete the folder yourself" in line
