"""Leftover names parsed with bounds (primitives/files/atomic.py)."""

from __future__ import annotations

import pytest

from slimkit.primitives.files.atomic import MAX_PID, leftover_pid, pid_alive, remove_leftovers
from tests.mounting import bind_mount


def test_leftover_names_are_parsed_with_integer_range_checks(tmp_path):
    target = tmp_path / "out"
    assert leftover_pid(target, ".out.partial-123-abcd") == ("partial", 123)
    assert leftover_pid(target, ".out.replaced-123-abcd") == ("replaced", 123)
    assert leftover_pid(target, f".out.partial-{MAX_PID + 1}-x") is None
    assert leftover_pid(target, ".out.partial-99999999999999999999-x") is None  # 20 digits: no OverflowError
    assert leftover_pid(target, ".out.partial-0-x") is None
    assert leftover_pid(target, ".other.partial-123-x") is None
    assert not pid_alive(10**20) and not pid_alive(-1)


def test_a_planted_leftover_with_a_huge_pid_is_left_alone(tmp_path):
    planted = tmp_path / ".out.partial-99999999999999999999-x"
    planted.mkdir()
    (planted / "mine.txt").write_text("keep")
    assert remove_leftovers(tmp_path / "out") == []
    assert (planted / "mine.txt").read_text() == "keep"


def test_a_dead_runs_partial_folder_holding_a_bind_mount_keeps_the_mounted_files(tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "data.txt").write_text("keep")
    partial = tmp_path / f".out.partial-{MAX_PID}-abcd"  # no such process: a dead run's
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "half.safetensors").write_bytes(b"x")
    assert not pid_alive(MAX_PID)  # Linux hands out ids below pid_max, at most MAX_PID
    with bind_mount(users, partial / "model" / "data"):
        notes = remove_leftovers(tmp_path / "out")
        assert len(notes) == 1 and notes[0].startswith(f"kept {partial.name}") and "a mount point" in notes[0]
        assert (users / "data.txt").read_text() == "keep"
        assert not (partial / "model" / "half.safetensors").exists()
    assert (users / "data.txt").read_text() == "keep"


def test_a_lock_file_holding_no_ascii_process_id_is_refused_in_one_line(tmp_path):
    from slimkit.primitives.errors import SlimkitError
    from slimkit.primitives.files.lock import acquire_lock

    for text in ("²\n", "9" * 30 + "\n"):
        (tmp_path / ".out.lock").write_text(text)
        with pytest.raises(SlimkitError, match="is not a slimkit lock file"):
            acquire_lock(tmp_path / "out")
    (tmp_path / ".out.lock").write_text("123\n")  # a lock file a killed process left: taken over
    acquire_lock(tmp_path / "out").release()
