"""Prose where it belongs, read from the source with :mod:`ast` and :mod:`tokenize` (nothing is imported).

* A module docstring says in a few lines what the module is for and points to its method note: at most
  :data:`MODULE_DOCSTRING_LINES` lines (counted on the raw docstring, as ``ast.get_docstring(..., clean=False)``
  gives it), with the exceptions in :data:`LONGER`, each with its reason. Derivations, history and measurements go to
  ``docs/methods/`` (see docs/methods/README.md).
* No docstring (module, class, function or attribute) and no comment names an issue or a session number: they go
  stale in code; the history lives in docs/ and the tracker.
* A ``Method note: docs/methods/<note>.md`` line names a note that exists.
* The README stays short: at most :data:`README_BYTES` (archives belong in docs/ and benchmarks/results/).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("primitives", "engine", "stages", "cli", "benchmarks")
"""Folders scanned at every depth; ``recipes/`` is scanned at its top level only."""

MODULE_DOCSTRING_LINES = 14
README_BYTES = 12 * 1024

LONGER = {
    "recipes/schema.py": (22, "its YAML example is parsed by tests/recipes/test_recipes.py"),
    "stages/reconstruct.py": (18, "`slimkit stage show reconstruct` prints it: what the stage does, refuses, reports"),
}
"""Module docstrings allowed more lines than :data:`MODULE_DOCSTRING_LINES`: ``path: (lines, why)``."""

NUMBERED_HISTORY = re.compile(r"\bissues? #?\d+|\bsessions? #?\d+", re.IGNORECASE)
METHOD_NOTE = re.compile(r"Method note: ``?(docs/methods/[\w.-]+\.md)")


def source_files() -> list[Path]:
    files = [ROOT / "__init__.py"]
    for folder in PACKAGE:
        files += sorted((ROOT / folder).rglob("*.py"))
    files += sorted((ROOT / "recipes").glob("*.py"))
    return [path for path in files if path.is_file()]


FILES = source_files()


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose(source: str) -> Iterator[tuple[int, str]]:
    """Every docstring-like string statement and every comment of a module, with its line."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_the_scan_sees_the_package():
    names = {rel(path) for path in FILES}
    assert {"__init__.py", "engine/runner.py", "stages/reconstruct.py", "recipes/schema.py", "cli/main.py"} <= names
    assert set(LONGER) <= names, "an exception names a module that no longer exists: drop it"


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_module_docstrings_are_short(path):
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
    limit = LONGER.get(rel(path), (MODULE_DOCSTRING_LINES, ""))[0]
    lines = len(docstring.splitlines())
    assert lines <= limit, (
        f"{rel(path)}: module docstring of {lines} lines (at most {limit}): say what the module is for, end with "
        "'Method note: docs/methods/<note>.md.' and move the rest into that note (docs/methods/README.md)"
    )


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_no_issue_or_session_numbers_in_code_prose(path):
    found = [
        f"{rel(path)}:{line}: {match.group(0)!r}"
        for line, text in prose(path.read_text(encoding="utf-8"))
        for match in NUMBERED_HISTORY.finditer(text)
    ]
    assert not found, "issue or session numbers in docstrings or comments (they belong in docs/): " + "; ".join(found)


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_method_notes_named_in_module_docstrings_exist(path):
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    missing = [note for note in METHOD_NOTE.findall(docstring) if not (ROOT / note).is_file()]
    assert not missing, f"{rel(path)} names method notes that do not exist: {missing}"


def test_the_history_pattern_catches_what_it_should():
    for text in ("(issue #17)", "issues 8, 9, 31", "the 8B table of issue 29", "Session 12 measured", "issue 30's"):
        assert NUMBERED_HISTORY.search(text), text
    for text in ("an issue with the input", "the session's budget", "issues a warning"):
        assert not NUMBERED_HISTORY.search(text), text


def test_the_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size:,} bytes (at most {README_BYTES:,}): move detail to docs/"
