"""The import layering, read from the source with :mod:`ast` (nothing is imported).

* Primitives are the bottom layer: no module under ``primitives/`` imports ``slimkit.recipes``, ``slimkit.cli``
  or ``benchmarks`` (the layers built on top of them), whether by absolute or relative import.
* Private names stay in their module: no module of slimkit or benchmarks imports a ``_name`` from another module
  (dunders such as ``__version__`` are public). What another module needs gets a public name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ("primitives", "engine", "stages", "recipes", "cli", "benchmarks", "data")
UPPER_LAYERS = (
    "slimkit.recipes",
    "slimkit.engine",
    "slimkit.stages",
    "slimkit.cli",
    "slimkit.benchmarks",
    "benchmarks",
    "recipes",
    "cli",
)


@dataclass(frozen=True)
class Import:
    """One import statement's target: ``module`` absolute, ``names`` as imported (empty for ``import module``)."""

    file: str
    line: int
    module: str
    names: tuple[str, ...]

    def __str__(self) -> str:
        what = f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"
        return f"{self.file}:{self.line}: {what}"


def module_name(path: Path, root: Path = ROOT) -> str:
    """The dotted name ``path`` imports as: the repository root is the ``slimkit`` package, except ``benchmarks``."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts and parts[0] == "benchmarks" else ".".join(("slimkit", *parts))


def imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in ``path``, relative ones resolved against the module's own package."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    file = str(path.relative_to(root))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=file)):
        if isinstance(node, ast.Import):
            found += [Import(file, node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append(Import(file, node.lineno, module, tuple(alias.name for alias in node.names)))
    return found


def source_files(*tops: str, root: Path = ROOT) -> list[Path]:
    return sorted(path for top in tops for path in (root / top).rglob("*.py"))


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_first_party(module: str) -> bool:
    return module.split(".")[0] in ("slimkit", "benchmarks")


def upper_layer_imports(files: list[Path], root: Path = ROOT) -> list[Import]:
    return [
        found
        for path in files
        for found in imports(path, root)
        if any(found.module == layer or found.module.startswith(layer + ".") for layer in UPPER_LAYERS)
    ]


def private_name_imports(files: list[Path], root: Path = ROOT) -> list[Import]:
    """Imports of first-party private names, each with only its private names."""
    found = [
        Import(each.file, each.line, each.module, tuple(name for name in each.names if is_private(name)))
        for path in files
        for each in imports(path, root)
        if is_first_party(each.module)
    ]
    return [each for each in found if each.names]


def test_the_scan_resolves_relative_imports_and_finds_both_kinds(tmp_path):
    (tmp_path / "primitives" / "family").mkdir(parents=True)
    module = tmp_path / "primitives" / "family" / "module.py"
    module.write_text(
        "from __future__ import annotations\n"
        "from ...engine.runner import run\n"
        "from ..other import _helper, public\n"
        "import benchmarks.run\n"
    )
    assert module_name(module, tmp_path) == "slimkit.primitives.family.module"
    assert [str(found) for found in upper_layer_imports([module], tmp_path)] == [
        "primitives/family/module.py:2: from slimkit.engine.runner import run",
        "primitives/family/module.py:4: import benchmarks.run",
    ]
    assert [str(found) for found in private_name_imports([module], tmp_path)] == [
        "primitives/family/module.py:3: from slimkit.primitives.other import _helper"
    ]


def test_primitives_import_nothing_from_recipes_cli_or_benchmarks():
    files = source_files("primitives")
    assert len(files) > 50, "the scan found too few primitives to mean anything"
    violations = upper_layer_imports(files)
    assert not violations, "primitives import an upper layer:\n" + "\n".join(map(str, violations))


def test_no_module_imports_a_private_name_from_another_module():
    files = [ROOT / "__init__.py", *source_files(*SOURCE)]
    violations = private_name_imports(files)
    assert not violations, "private names imported from another module:\n" + "\n".join(map(str, violations))
