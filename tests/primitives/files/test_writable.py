"""primitives/files/writable.py: the one writability check of an output path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.writable import check_writable


def test_a_missing_path_under_a_writable_folder_passes(tmp_path) -> None:
    check_writable("--out", tmp_path / "a" / "b" / "out")  # missing folders are created later
    (tmp_path / "file.json").write_text("{}")
    check_writable("--json", tmp_path / "file.json", replace=True)


def test_a_path_under_a_file_is_refused(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SlimkitError, match=r"^--out .*notes.txt/out: .*notes.txt is a file, not a folder$"):
        check_writable("--out", tmp_path / "notes.txt" / "out")


def test_a_read_only_folder_or_file_is_refused(tmp_path, monkeypatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    readonly = tmp_path / "readonly.json"
    readonly.write_text("{}")
    real_access = os.access  # what the process may do is faked, so the test holds for root too
    denied = (locked, readonly)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) not in denied and real_access(path, mode))
    with pytest.raises(SlimkitError, match="no permission to write in"):
        check_writable("--out", locked / "out")
    with pytest.raises(SlimkitError, match=r"no permission to replace it \(the file is not writable\)"):
        check_writable("--json", readonly, replace=True)
    check_writable("--json", readonly)  # not replaced: only the folder it is written in matters
    with pytest.raises(SlimkitError, match=r"no permission to replace it \(the folder is not writable\)"):
        check_writable("--out", locked, replace=True)
