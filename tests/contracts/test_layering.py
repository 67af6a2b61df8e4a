"""The import layering, read from the source with :mod:`ast` (nothing is imported).

* Primitives are the bottom layer: no module under ``primitives/`` imports ``slimkit.recipes``, ``slimkit.cli``
  or ``benchmarks`` (the layers built on top of them), whether by absolute or relative import.
* The engine asks stages only through their interface: no module of ``engine/`` or ``recipes/`` imports a stage
  module (``slimkit.stages.*``); the one exception is the catalogue's loader, which imports the ``slimkit.stages``
  package so that its modules register themselves. No engine module compares a value with a registered stage's name.
* One direction between the engine and the recipes: the engine runs recipes (it imports ``slimkit.recipes``), and no
  module of ``recipes/`` imports ``slimkit.engine``, not even for type checking.
* A stage's state is its own: no module imports another stage's state type (the type its ``start`` returns), except
  the stage's own companion modules (``stages/lowrank_prepass.py`` for ``stages/lowrank.py``).
* Nothing below the API (``primitives/``, ``engine/``, ``stages/``, ``recipes/``) imports the top-level ``slimkit``
  module (the public API built on them), the command line or the benchmarks.
* Private names stay in their module: no module of slimkit or benchmarks imports a ``_name`` from another module
  (dunders such as ``__version__`` are public). What another module needs gets a public name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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


BELOW_THE_API = ("primitives", "engine", "stages", "recipes")
STAGES_PACKAGE = "slimkit.stages"
REGISTRY_LOADER = Import("recipes/catalogue.py", 0, STAGES_PACKAGE, ())
"""The one import of the stages below them: the catalogue's loader imports the package (its modules register
their stages); compared without its line."""


def stage_module_imports(files: list[Path], root: Path = ROOT) -> list[Import]:
    """Imports of ``slimkit.stages`` or a module in it (a ``from slimkit import stages`` included), less the
    registry's loader."""
    found = []
    for path in files:
        for each in imports(path, root):
            named = each.module == STAGES_PACKAGE or each.module.startswith(STAGES_PACKAGE + ".")
            named = named or (each.module == "slimkit" and "stages" in each.names)
            if named and (each.file, each.module, each.names) != (
                REGISTRY_LOADER.file,
                REGISTRY_LOADER.module,
                REGISTRY_LOADER.names,
            ):
                found.append(each)
    return found


def api_imports(files: list[Path], root: Path = ROOT) -> list[Import]:
    """Imports of the top-level ``slimkit`` module itself (``import slimkit``, ``from slimkit import run``; a
    ``from slimkit import primitives`` names a package below the API and is left out), of the CLI and of the
    benchmarks."""
    below = {"primitives", "engine", "stages", "recipes"}
    found = []
    for path in files:
        for each in imports(path, root):
            top = each.module == "slimkit" and (not each.names or not set(each.names) <= below)
            upper = any(each.module == m or each.module.startswith(m + ".") for m in ("slimkit.cli", "benchmarks"))
            if top or upper:
                found.append(each)
    return found


def _strings(node: ast.expr) -> Iterator[str]:
    """The string constants ``node`` is or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from _strings(element)


def stage_name_comparisons(files: list[Path], names: set[str], root: Path = ROOT) -> list[str]:
    """``FILE:LINE: NAME`` for every comparison (``==``, ``!=``, ``in``, ``not in``, ``match`` cases) with a string
    that is one of ``names``."""
    found = []
    for path in files:
        file = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(), filename=file)):
            operands: list[ast.expr] = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.MatchValue):
                operands = [node.value]
            for operand in operands:
                found += [f"{file}:{node.lineno}: {value}" for value in _strings(operand) if value in names]
    return found


def registered_stage_names() -> set[str]:
    from slimkit.recipes.catalogue import stage_names

    return set(stage_names())


def test_the_scans_find_stage_imports_api_imports_and_name_comparisons(tmp_path):
    (tmp_path / "engine").mkdir()
    module = tmp_path / "engine" / "module.py"
    module.write_text(
        "import slimkit\n"
        "from slimkit import primitives\n"
        "from slimkit.stages.prune import PruneArgs\n"
        "from ..stages import lowrank\n"
        "def f(spec, name):\n"
        "    if spec.stage == 'prune' or name in ('lora', 'other'):\n"
        "        return 'prune'\n"
    )
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "catalogue.py").write_text("import slimkit.stages\n")
    files = [module, tmp_path / "recipes" / "catalogue.py"]
    assert [str(found) for found in stage_module_imports(files, tmp_path)] == [
        "engine/module.py:3: from slimkit.stages.prune import PruneArgs",
        "engine/module.py:4: from slimkit.stages import lowrank",
    ]
    assert [str(found) for found in api_imports(files, tmp_path)] == ["engine/module.py:1: import slimkit"]
    assert sorted(stage_name_comparisons([module], {"prune", "lora"}, tmp_path)) == [
        "engine/module.py:6: lora",
        "engine/module.py:6: prune",
    ]


def test_the_engine_and_the_recipes_import_no_stage_module():
    files = source_files("engine", "recipes")
    assert len(files) > 15, "the scan found too few engine modules to mean anything"
    violations = stage_module_imports(files)
    assert not violations, "the engine imports stage modules:\n" + "\n".join(map(str, violations))
    loader = [i for i in imports(ROOT / "recipes" / "catalogue.py") if i.module == STAGES_PACKAGE]
    assert len(loader) == 1, "the catalogue's loader is the one import of the stages package"


def engine_imports(files: list[Path], root: Path = ROOT) -> list[Import]:
    """Imports of ``slimkit.engine`` or a module in it (``from slimkit import engine`` included)."""
    found = []
    for path in files:
        for each in imports(path, root):
            if each.module == "slimkit.engine" or each.module.startswith("slimkit.engine."):
                found.append(each)
            elif each.module == "slimkit" and "engine" in each.names:
                found.append(each)
    return found


def test_the_scan_finds_a_recipes_module_importing_the_engine(tmp_path):
    (tmp_path / "recipes").mkdir()
    module = tmp_path / "recipes" / "module.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from slimkit.engine.context import Context\n"
        "from slimkit import engine\n"
        "from slimkit.primitives import settings\n"
    )
    assert sorted(str(found) for found in engine_imports([module], tmp_path)) == [
        "recipes/module.py:3: from slimkit.engine.context import Context",
        "recipes/module.py:4: from slimkit import engine",
    ]


def test_the_recipes_import_nothing_from_the_engine():
    files = source_files("recipes")
    assert len(files) >= 5, "the scan found too few recipes modules to mean anything"
    violations = engine_imports(files)
    assert not violations, "recipes modules import the engine (it imports them):\n" + "\n".join(map(str, violations))


def state_types() -> dict[str, str]:
    """Each registered layer stage's state type name -> the module defining the stage (``slimkit.stages.lowrank``)."""
    import typing

    from slimkit.recipes.catalogue import STAGES, stage_names

    stage_names()
    found = {}
    for definition in STAGES.values():
        start = getattr(type(definition.stage), "start", None)
        if start is not None:
            state = typing.get_type_hints(start)["return"]
            found[state.__name__] = type(definition.stage).__module__
    return found


def foreign_state_imports(files: list[Path], states: dict[str, str], root: Path = ROOT) -> list[str]:
    """``FILE:LINE: NAME`` for each import of a stage's state type by a module that is not the stage's own (or a
    companion module whose name starts with the stage module's)."""
    found = []
    for path in files:
        importer = module_name(path, root)
        for each in imports(path, root):
            for name in each.names:
                owner = states.get(name)
                if owner is not None and not importer.startswith(owner):
                    found.append(f"{each.file}:{each.line}: {name}")
    return found


def test_the_state_scan_finds_an_import_of_another_stages_state(tmp_path):
    (tmp_path / "stages").mkdir()
    module = tmp_path / "stages" / "other.py"
    module.write_text("from slimkit.stages.lowrank import LowRankState\n")
    companion = tmp_path / "stages" / "lowrank_prepass.py"
    companion.write_text("from slimkit.stages.lowrank import LowRankState\n")
    states = {"LowRankState": "slimkit.stages.lowrank"}
    assert foreign_state_imports([module, companion], states, tmp_path) == ["stages/other.py:1: LowRankState"]


def test_no_stage_reads_another_stages_state():
    states = state_types()
    assert {"LowRankState", "PruneLayerState", "ReconstructState"} <= set(states)
    files = source_files("stages", "engine", "recipes", "primitives")
    violations = foreign_state_imports(files, states)
    assert not violations, "modules import another stage's state:\n" + "\n".join(violations)


def test_nothing_below_the_api_imports_the_api_the_cli_or_the_benchmarks():
    files = source_files(*BELOW_THE_API)
    violations = api_imports(files)
    assert not violations, "modules below the API import it:\n" + "\n".join(map(str, violations))


def test_no_engine_module_compares_a_stage_name():
    names = registered_stage_names()
    assert {"prune", "lora", "reconstruct"} <= names
    violations = stage_name_comparisons(source_files("engine", "recipes"), names)
    assert not violations, "engine modules compare stage names:\n" + "\n".join(violations)
