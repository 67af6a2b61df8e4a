"""Finding, parsing and overriding recipes.

A recipe argument is a bundled name (``wanda-channels``) or a path to a YAML file. YAML is read
with ``yaml.safe_load`` only. Overrides are ``dotted.path=value`` pairs whose value is parsed as
YAML (``target.ratio=0.3``, ``stages.0.args.scorer=magnitude``, ``eval.zeroshot=null``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from slimkit.primitives.errors import SlimkitError, unknown
from slimkit.recipes.schema import Recipe, format_validation_error


def bundled_recipes() -> dict[str, Path]:
    folder = resources.files("slimkit.recipes")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def recipe_path(name_or_file: str) -> Path:
    bundled = bundled_recipes()
    if name_or_file in bundled:
        return bundled[name_or_file]
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SlimkitError(f"recipe file not found: {path}")
        return path
    raise SlimkitError(
        unknown("recipe", name_or_file, sorted(bundled), label="bundled", tail=", or a path to a .yaml file")
    )


def read_recipe_text(path: Path) -> str:
    """A recipe file's text (UTF-8); an unreadable or non-UTF-8 file is one :class:`SlimkitError` line."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise SlimkitError(
            f"recipe {path}: not UTF-8 text ({error.reason}, byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise SlimkitError(f"cannot read recipe {path}: {error.strerror or error}") from None


def parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SlimkitError(f"{origin}:{where}: YAML syntax error: {problem}") from None
    if not isinstance(data, dict):
        raise SlimkitError(f"{origin}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise SlimkitError(f"--set '{assignment}': expected key=value, e.g. target.ratio=0.3")
    key, _, raw = assignment.partition("=")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise SlimkitError(f"--set {key}: cannot parse value '{raw}'") from None
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SlimkitError(f"--set {key}: '{part}' is not an index of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if i == 0 and part == "model" and isinstance(node.get(part), str):
                    node[part] = {"source": node[part]}  # the string shorthand, expanded to set one field
                node = node.setdefault(part, {})
                if node is None:
                    raise SlimkitError(f"--set {key}: '{part}' is null")
        else:
            raise SlimkitError(f"--set {key}: '{'.'.join(parts[:i])}' is not a mapping or list")


def validate(data: dict[str, Any], origin: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        raise SlimkitError(f"{origin}: {format_validation_error(error)}") from None


def load_recipe(name_or_file: str, overrides: list[str] | None = None) -> tuple[Recipe, dict[str, Any]]:
    """The validated recipe and the raw (overridden) mapping it came from."""
    path = recipe_path(name_or_file)
    text = read_recipe_text(path)
    data = parse_yaml(text, str(path))
    for assignment in overrides or []:
        apply_override(data, assignment)
    return validate(data, path.name), data
