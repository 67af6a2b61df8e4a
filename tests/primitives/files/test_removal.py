"""The one deletion primitive (primitives/files/removal.py): only what is listed, never across a mount."""

from __future__ import annotations

import os
from pathlib import Path

from slimkit.primitives.files.removal import (
    MAX_DEPTH,
    MOUNT_POINT,
    NOT_LISTED,
    OTHER_FILE_SYSTEM,
    Blocker,
    listing,
    remove_owned,
    survey,
)
from tests.contracts.hostile import tree_checksum
from tests.mounting import bind_mount, tmpfs


def output(root: Path) -> Path:
    """A run-like output: ``model/`` with two files, a report, a nested export folder."""
    folder = root / "out"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "model" / "model.safetensors").write_bytes(b"x" * 10)
    (folder / "report.json").write_text("{}")
    (folder / "export" / "hf").mkdir(parents=True)
    (folder / "export" / "hf" / "config.json").write_text("{}")
    return folder


def test_listing_names_every_file_and_folder_at_every_depth(tmp_path):
    files, folders = listing(output(tmp_path))
    assert files == ["export/hf/config.json", "model/config.json", "model/model.safetensors", "report.json"]
    assert folders == ["export", "export/hf", "model"]


def test_a_folder_holding_only_what_is_listed_goes_entirely(tmp_path):
    folder = output(tmp_path)
    files, folders = listing(folder)
    assert survey(folder, {*files, *folders}) == []
    assert remove_owned(folder, {*files, *folders}) == []
    assert not folder.exists()


def test_a_file_not_listed_stays_at_any_depth_with_its_folders(tmp_path):
    folder = output(tmp_path)
    files, folders = listing(folder)
    (folder / "model" / "notes.txt").write_text("mine")
    assert survey(folder, {*files, *folders}) == [Blocker("model/notes.txt", NOT_LISTED)]
    left = remove_owned(folder, {*files, *folders})
    assert left == [Blocker("model/notes.txt", NOT_LISTED)]
    assert (folder / "model" / "notes.txt").read_text() == "mine"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["model", "model/notes.txt"]


def test_a_symbolic_link_goes_as_a_link_and_its_target_stays(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep")
    folder = output(tmp_path)
    (folder / "model" / "link").symlink_to(precious)
    assert remove_owned(folder) == []
    assert not folder.exists() and (precious / "data.txt").read_text() == "keep"


def test_a_bind_mount_inside_is_never_entered(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    before = tree_checksum(users)
    folder = output(tmp_path)
    files, folders = listing(folder)
    with bind_mount(users, folder / "model" / "data"):
        listed = {*files, *folders, "model/data", "model/data/thesis.tex"}  # even if a marker lists it
        assert survey(folder, listed) == [Blocker("model/data", MOUNT_POINT)]
        assert remove_owned(folder, listed) == [Blocker("model/data", MOUNT_POINT)]
        assert remove_owned(folder) == [Blocker("model/data", MOUNT_POINT)]
        assert tree_checksum(users) == before
    assert tree_checksum(users) == before


def test_another_file_system_inside_is_never_entered(tmp_path):
    folder = output(tmp_path)
    with tmpfs(folder / "model" / "scratch") as scratch:
        (scratch / "file").write_text("on tmpfs")
        assert remove_owned(folder) == [Blocker("model/scratch", OTHER_FILE_SYSTEM)]
        assert (scratch / "file").read_text() == "on tmpfs"


def test_a_folder_that_is_a_mount_point_is_not_touched(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "a.txt").write_text("keep")
    with bind_mount(users, tmp_path / ".out.partial-1-x") as leftover:
        assert remove_owned(leftover) == [Blocker(".", MOUNT_POINT)]
        assert (users / "a.txt").read_text() == "keep"


def test_nesting_deeper_than_the_cap_is_not_entered(tmp_path):
    folder = tmp_path / "deep"
    deepest = folder.joinpath(*["d"] * (MAX_DEPTH + 2))
    deepest.mkdir(parents=True)
    left = remove_owned(folder)
    assert len(left) == 1 and left[0].reason.startswith("nested more than")
    assert deepest.is_dir()


def test_a_file_or_link_at_the_path_goes_and_a_missing_one_is_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert remove_owned(tmp_path / "link") == [] and (tmp_path / "file").exists()
    assert remove_owned(tmp_path / "file") == [] and not os.path.lexists(tmp_path / "file")
    assert remove_owned(tmp_path / "missing") == []
