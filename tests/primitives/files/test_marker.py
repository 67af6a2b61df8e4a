"""Markers written with every depth listed and read with bounds (primitives/files/marker.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.marker import (
    MAX_MARKER_BYTES,
    lists_top_level_only,
    read_marker,
    unlisted_hint,
    write_marker,
)

NAME = ".slimkit-export.json"


def test_a_marker_lists_what_the_folder_holds_and_reads_back(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "report.json").write_text("{}")
    write_marker(tmp_path, NAME, {"written_by": "slimkit export"})
    record = json.loads((tmp_path / NAME).read_text())
    assert record["files"] == ["model/config.json", "report.json"] and record["folders"] == ["model"]
    assert read_marker(tmp_path, NAME) == {"model/config.json", "report.json", "model", NAME}


def refused(tmp_path, fragment: str) -> None:
    start = time.monotonic()
    with pytest.raises(SlimkitError, match=fragment):
        read_marker(tmp_path, NAME)
    assert time.monotonic() - start < 10  # a FIFO or /dev/zero would block or read forever


def test_a_fifo_marker_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / NAME)
    refused(tmp_path, "a FIFO")


def test_a_marker_is_never_read_through_a_symbolic_link(tmp_path):
    (tmp_path / NAME).symlink_to("/dev/zero")
    refused(tmp_path, "is a symbolic link")
    (tmp_path / NAME).unlink()
    (tmp_path / "real.json").write_text('{"files": []}')
    (tmp_path / NAME).symlink_to(tmp_path / "real.json")
    refused(tmp_path, "is a symbolic link")


def test_a_huge_marker_is_refused_by_its_size_without_reading_it(tmp_path):
    with open(tmp_path / NAME, "wb") as handle:
        handle.truncate(3 << 30)  # a sparse 3 GB file
    refused(tmp_path, f"more than the {MAX_MARKER_BYTES >> 20} MiB a marker may hold")


def test_a_deeply_nested_marker_is_one_line(tmp_path):
    (tmp_path / NAME).write_text('{"files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(tmp_path, "nested more than")


@pytest.mark.parametrize(
    "files",
    [["/etc/passwd"], ["../outside"], ["a/../../b"], [3], "model", [""], ["a//b"]],
    ids=["absolute", "dotdot", "nested-dotdot", "number", "string", "empty", "double-slash"],
)
def test_a_marker_listing_paths_outside_the_folder_is_refused(tmp_path, files):
    (tmp_path / NAME).write_text(json.dumps({"files": files}))
    refused(tmp_path, "'files'")


def test_a_marker_that_is_not_an_object_or_lists_nothing_is_refused(tmp_path):
    (tmp_path / NAME).write_text("[]")
    refused(tmp_path, "expected a JSON object")
    (tmp_path / NAME).write_text("{}")
    refused(tmp_path, "lists no 'files'")


def test_a_marker_listing_top_level_names_only_is_named_in_refusals(tmp_path):
    (tmp_path / NAME).write_text(json.dumps({"files": ["model"]}))
    assert lists_top_level_only(tmp_path, NAME)
    assert "lists top-level names only" in unlisted_hint(tmp_path, NAME)
    write_marker(tmp_path, NAME, {})
    assert not lists_top_level_only(tmp_path, NAME) and unlisted_hint(tmp_path, NAME) == ""
