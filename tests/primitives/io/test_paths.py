"""Paths as the API takes them (:mod:`slimkit.primitives.io.paths`): types, ``~`` expansion, list arguments and the
file system's length limits, each refusal one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.paths import STAGING_NAME_BYTES, as_names, as_path, check_path_length, path_text


@pytest.mark.parametrize("value", ["runs/x", Path("runs/x"), b"runs/x"])
def test_str_pathlike_and_bytes_are_the_same_path(value):
    assert as_path(value, "out") == Path("runs/x")


def test_text_keeps_the_path_as_given_and_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert path_text("./model", "source") == "./model"
    assert path_text(b"~/m", "source") == str(tmp_path / "m")
    with pytest.raises(SlimkitError, match=r"^out ~nosuchuser-slimkit/x: cannot expand ~nosuchuser-slimkit: no user"):
        path_text("~nosuchuser-slimkit/x", "out")


@pytest.mark.parametrize(("value", "kind"), [(3, "int"), (None, "NoneType"), (["a"], "list")])
def test_other_types_are_one_line(value, kind):
    with pytest.raises(SlimkitError, match=rf"^out: expected a path \(str, os.PathLike or bytes\), got {kind}$"):
        as_path(value, "out")
    with pytest.raises(SlimkitError, match="cannot hold a NUL byte"):
        as_path("a\x00b", "out")


def test_a_bare_string_is_not_a_list():
    assert as_names(("wikitext2", "ptb"), "perplexity") == ["wikitext2", "ptb"] and as_names(None, "x") is None
    with pytest.raises(SlimkitError, match=r"^perplexity: expected a list of strings, got the string 'wikitext2'"):
        as_names("wikitext2", "perplexity")
    with pytest.raises(SlimkitError, match="a list holding a non-string"):
        as_names(["a", 1], "zeroshot")
    with pytest.raises(SlimkitError, match="got int"):
        as_names(5, "zeroshot")


def test_path_lengths_count_the_staging_sibling_and_the_files_inside(tmp_path):
    room = 4096 - 1 - STAGING_NAME_BYTES - len(str(tmp_path)) - 1  # bytes left for one name under tmp_path
    fits = tmp_path / ("x" * min(room, 200))
    check_path_length("--out", fits)
    deep = tmp_path.joinpath(*["d" * 200] * ((4096 - len(str(tmp_path))) // 201))
    with pytest.raises(SlimkitError, match=r"^--out: the path is \d+ bytes and 48 more are needed for its staging"):
        check_path_length("--out", deep)
    near = tmp_path.joinpath(*["d" * 200] * 18)
    check_path_length("--out", near)
    with pytest.raises(SlimkitError, match="staging sibling and the files inside it"):
        check_path_length("--out", near, ["x" * (4096 - len(os.fsencode(str(near))) - STAGING_NAME_BYTES)])
    with pytest.raises(SlimkitError, match=r"the file name x+\.\.\. is 230 bytes; .* use at most 207"):
        check_path_length("--out", tmp_path / ("x" * 230))
