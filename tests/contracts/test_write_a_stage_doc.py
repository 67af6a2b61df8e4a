"""The code of docs/write-a-stage.md runs as written: its Python blocks, in order, define, register and run the
page's stage on a tiny Llama (``MODEL``, ``OUT`` given as the page says)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from slimkit.recipes.catalogue import STAGES, stage_names

PAGE = Path(__file__).resolve().parents[2] / "docs" / "write-a-stage.md"


def python_blocks(text: str) -> list[str]:
    """The page's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_scan_finds_python_blocks_only():
    text = "a\n```python\nx = 1\n```\n```toml\ny = 2\n```\n```python\nz = x\n```\n"
    assert python_blocks(text) == ["x = 1\n", "z = x\n"]


def test_the_pages_code_defines_registers_and_runs_its_stage(tiny_llama_dir, tmp_path, capsys):
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) == 3
    stage_names()
    module = types.ModuleType("write_a_stage_doc")  # a module of its own, as the page's code would live in
    module.__dict__.update(MODEL=str(tiny_llama_dir), OUT=str(tmp_path / "out"))
    sys.modules[module.__name__] = module
    try:
        for block in blocks:
            exec(compile(block, str(PAGE), "exec"), module.__dict__)  # the page's own code
        assert STAGES["keep_top_channels"].scope == "layer"
        assert "kept_channels" in capsys.readouterr().out
        assert (tmp_path / "out" / "report.json").exists()
    finally:
        STAGES.pop("keep_top_channels", None)
        sys.modules.pop(module.__name__, None)
    with pytest.raises(KeyError):
        STAGES["keep_top_channels"]
