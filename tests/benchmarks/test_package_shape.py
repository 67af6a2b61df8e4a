"""``benchmarks/`` as a small package, read from the source with :mod:`ast` (nothing is imported):

* no import cycle between its modules (imports inside functions included: a cycle is a cycle when it runs);
* no module over :data:`MAX_LINES` lines;
* one module calls slimkit's engine and stages (:data:`ENGINE_CALLS`), so a change of the stage contract is ported in
  one place.
"""

from __future__ import annotations

from pathlib import Path

from tests.contracts.test_layering import imports, module_name, source_files

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600
ENGINE_CALLS = "benchmarks/core/engine_calls.py"
ENGINE_AND_STAGES = ("slimkit.engine", "slimkit.stages")


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> the benchmarks modules it imports``: ``from package import module`` counts as importing the
    module; importing a module's parent package does not count."""
    modules = {module_name(path, root) for path in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for path in files:
        source = module_name(path, root)
        for found in imports(path, root):
            targets = [f"{found.module}.{name}" for name in found.names if f"{found.module}.{name}" in modules]
            if not targets and found.module in modules:
                targets = [found.module]
            graph[source].update(target for target in targets if target != source)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def long_modules(files: list[Path], limit: int = MAX_LINES, root: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)}: {lines} lines"
        for path in files
        if (lines := len(path.read_text().splitlines())) > limit
    ]


def engine_imports(files: list[Path], root: Path = ROOT) -> list[str]:
    """Imports of slimkit's engine or stages outside :data:`ENGINE_CALLS`."""
    return [
        str(found)
        for path in files
        if str(path.relative_to(root)) != ENGINE_CALLS
        for found in imports(path, root)
        if any(found.module == top or found.module.startswith(top + ".") for top in ENGINE_AND_STAGES)
    ]


def test_the_scans_find_a_cycle_a_long_module_and_an_engine_import(tmp_path):
    (tmp_path / "benchmarks" / "core").mkdir(parents=True)
    write = {
        "benchmarks/__init__.py": "",
        "benchmarks/core/__init__.py": "",
        "benchmarks/core/errors.py": "import os\n",
        "benchmarks/a.py": "from benchmarks.core import errors\nfrom benchmarks import b\n",
        "benchmarks/b.py": "def f():\n    from benchmarks.c import g\n",  # a lazy import closes the cycle too
        "benchmarks/c.py": "import benchmarks.a\nfrom slimkit.engine.registry import STAGES\n" + "x = 1\n" * 3,
    }
    for name, text in write.items():
        (tmp_path / name).write_text(text)
    files = sorted((tmp_path / "benchmarks").rglob("*.py"))
    graph = import_graph(files, tmp_path)
    assert graph["benchmarks.a"] == {"benchmarks.core.errors", "benchmarks.b"}
    assert cycles(graph) == [["benchmarks.a", "benchmarks.b", "benchmarks.c"]]
    assert long_modules(files, 4, tmp_path) == ["benchmarks/c.py: 5 lines"]
    assert engine_imports(files, tmp_path) == ["benchmarks/c.py:2: from slimkit.engine.registry import STAGES"]


def test_the_benchmarks_have_no_import_cycle():
    files = source_files("benchmarks")
    assert len(files) > 20, "the scan found too few benchmark modules to mean anything"
    found = cycles(import_graph(files))
    assert not found, "import cycles in benchmarks/:\n" + "\n".join(" <-> ".join(group) for group in found)


def test_no_benchmark_module_is_over_the_limit():
    found = long_modules(source_files("benchmarks"))
    assert not found, f"benchmark modules over {MAX_LINES} lines (split them):\n" + "\n".join(found)


def test_one_module_calls_the_engine_and_the_stages():
    found = engine_imports(source_files("benchmarks"))
    assert not found, f"call slimkit's engine and stages through {ENGINE_CALLS}:\n" + "\n".join(found)
