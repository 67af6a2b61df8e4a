"""The architecture map names only paths that exist: every backticked repository path in ``docs/ARCHITECTURE.md``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("primitives", "engine", "stages", "recipes", "cli", "benchmarks", "tests", "docs", "data")
CODE_SPAN = re.compile(r"`([^`\s]+)`")


def named_paths(text: str) -> list[str]:
    """Backticked spans that name a repository path: they start with a top-level folder (or are a root file such as
    ``pyproject.toml``); a ``*`` or ``<...>`` marks a pattern, which is checked up to its first wildcard."""
    found = []
    for span in CODE_SPAN.findall(text):
        span = span.rstrip(".,:;")
        first = span.split("/")[0]
        if (first in TOPS and "/" in span) or span in ("pyproject.toml", "Makefile", "README.md", "CHANGELOG.md"):
            found.append(span)
    return found


def exists(span: str) -> bool:
    literal = re.split(r"[*<{]", span)[0]
    if literal != span:  # a pattern: its fixed prefix must be a folder or the start of some file name
        parent = ROOT / literal.rpartition("/")[0]
        return parent.is_dir() and any(p.name.startswith(literal.rpartition("/")[2]) for p in parent.iterdir())
    return (ROOT / span).exists()


def test_the_scan_finds_paths_and_patterns():
    text = "see `engine/runner.py`, `recipes/*.yaml`, `tests/primitives/<family>/`, `ratio: 0.2` and `Makefile`"
    assert named_paths(text) == ["engine/runner.py", "recipes/*.yaml", "tests/primitives/<family>/", "Makefile"]
    assert exists("engine/runner.py") and exists("recipes/*.yaml") and exists("tests/primitives/<family>/")
    assert not exists("engine/no_such_module.py")


def test_every_path_the_architecture_map_names_exists():
    paths = named_paths((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert len(paths) > 40, "the scan found too few paths to mean anything"
    missing = sorted({p for p in paths if not exists(p)})
    assert not missing, "docs/ARCHITECTURE.md names paths that do not exist:\n" + "\n".join(missing)
