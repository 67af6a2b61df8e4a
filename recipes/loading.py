"""Finding, parsing and overriding recipes.

A recipe argument is a bundled name (``wanda-channels``) or a path to a YAML file (a regular file of at most
:data:`MAX_RECIPE_BYTES`). YAML is read with :func:`~slimkit.recipes.safe_yaml.load_yaml` only: PyYAML's safe
loader with bounded alias expansion and nesting, string keys, no repeated keys and plain values. Overrides are
``dotted.path=value`` pairs whose value is parsed the same way (``target.ratio=0.3``,
``stages.0.args.scorer=magnitude``, ``eval.zeroshot=null``); a list index is ASCII digits, and the index one past
the end of a list appends (``stages.1={stage: distill, args: {steps: 50}}`` adds recovery to a one-stage recipe).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from slimkit.primitives.errors import SlimkitError, format_validation_error, unknown
from slimkit.recipes.safe_yaml import load_yaml
from slimkit.recipes.schema import Recipe

MAX_RECIPE_BYTES = 1 << 20
"""The largest recipe file read (a bundled recipe is 1 to 3 KiB)."""


def bundled_recipes() -> dict[str, Path]:
    folder = resources.files("slimkit.recipes")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def recipe_path(name_or_file: str) -> Path:
    bundled = bundled_recipes()
    if name_or_file in bundled:
        return bundled[name_or_file]
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise SlimkitError(f"recipe file not found: {path}")
        if not path.is_file() or path.is_fifo():
            raise SlimkitError(f"recipe {path} is not a regular file; give a .yaml file")
        return path
    raise SlimkitError(
        unknown("recipe", name_or_file, sorted(bundled), label="bundled", tail=", or a path to a .yaml file")
    )


def read_recipe_text(path: Path) -> str:
    """A recipe file's text (UTF-8); an unreadable, oversized or non-UTF-8 file, or anything but a regular file, is
    one :class:`SlimkitError` line. The file is opened without blocking and checked on the open descriptor, so a
    named pipe swapped in after :func:`recipe_path`'s check cannot block the read."""
    import os
    import stat

    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(descriptor, "rb") as handle:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise SlimkitError(f"recipe {path} is not a regular file; give a .yaml file")
            if status.st_size > MAX_RECIPE_BYTES:
                raise SlimkitError(
                    f"recipe {path}: {status.st_size:,} bytes, more than the {MAX_RECIPE_BYTES >> 10} KiB a recipe "
                    "may hold"
                )
            data = handle.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:  # grew after the check
            raise SlimkitError(f"recipe {path}: more than the {MAX_RECIPE_BYTES >> 10} KiB a recipe may hold")
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SlimkitError(
            f"recipe {path}: not UTF-8 text ({error.reason}, byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise SlimkitError(f"cannot read recipe {path}: {error.strerror or error}") from None


def parse_yaml(text: str, origin: str) -> dict[str, Any]:
    data = load_yaml(text, origin)
    if not isinstance(data, dict):
        raise SlimkitError(f"{origin}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise SlimkitError(f"--set '{assignment}': expected key=value, e.g. target.ratio=0.3")
    key, _, raw = assignment.partition("=")
    value = load_yaml(raw, f"--set {key}")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            appends = last and part.isascii() and part.isdigit() and int(part) == len(node)
            if not (part.isascii() and part.isdigit()) or (int(part) >= len(node) and not appends):
                raise SlimkitError(
                    f"--set {key}: '{part}' is not an index of a list of {len(node)}"
                    + (f" (index {len(node)} appends)" if last else "")
                )
            if appends:
                node.append(value)
            elif last:
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
