"""The distribution maps every sub-package and ships recipes, task templates and data."""

from __future__ import annotations

import tomllib
from pathlib import Path

import slimkit

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {"slimkit", "slimkit.data"}
    for top in ("primitives", "engine", "stages", "recipes", "cli"):
        for init in (ROOT / top).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / top).parts
            found.add(".".join(("slimkit", top, *relative)))
    assert found == listed


def test_package_data_resolves_from_the_import_namespace():
    from slimkit.primitives.datasets.data_paths import data_root
    from slimkit.recipes.loading import bundled_recipes

    assert (data_root() / "wikitext2" / "SOURCE.md").is_file()
    assert "wanda-channels" in bundled_recipes()
    assert slimkit.__version__


def test_public_api():
    assert callable(slimkit.load) and callable(slimkit.save) and callable(slimkit.load_source)
