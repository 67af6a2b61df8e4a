"""What the benchmark tools read and where they write, under the rules the ``slimkit`` CLI follows.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.grid import BenchError
from slimkit.primitives.errors import SlimkitError

MAX_YAML_BYTES = 1 << 20
"""The largest grid or kept recipe file read (a grid is a few KiB)."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one :class:`BenchError` line (printed ``error: ...``, exit 2) instead of
    the usage text and a message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise BenchError(message)


def read_yaml_file(path: Path, what: str) -> Any:
    """The value of the YAML file ``path`` (``what`` names it in errors, e.g. "grid file"), read as the module says."""
    from slimkit.primitives.io.folder import check_regular_file
    from slimkit.recipes.safe_yaml import load_yaml

    try:
        size = check_regular_file(Path(path)).st_size
        if size > MAX_YAML_BYTES:
            raise BenchError(f"{what} {path}: {size:,} bytes, more than the {MAX_YAML_BYTES >> 10} KiB it may hold")
        text = Path(path).read_text(encoding="utf-8")
        return load_yaml(text, str(path))
    except SlimkitError as error:
        raise BenchError(f"{what}: {error}") from None
    except UnicodeDecodeError as error:
        raise BenchError(f"{what} {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise BenchError(f"cannot read {what} {path}: {error.strerror or error}") from None


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (``what`` names it in errors, e.g. "--reuse"), read with bounds."""
    from slimkit.primitives.io.folder import read_json_object

    try:
        return read_json_object(Path(path))
    except SlimkitError as error:
        raise BenchError(f"{what}: {error}") from None


def check_folder_option(option: str, path: Path, writes: str) -> None:
    """One line, before any work, for a folder option (``--out``, ``--keep``) no benchmark may write in: a name no
    file system takes, a protected folder, or an existing file. ``writes`` says what goes there."""
    from slimkit.primitives.files.guard import check_path_name, protected_reason

    try:
        check_path_name(option, Path(path))
    except SlimkitError as error:
        raise BenchError(str(error)) from None
    reason = protected_reason(Path(path))
    if reason is not None:
        raise BenchError(f"{option} {path} is {reason}; {writes} go in a folder of their own: name a new folder")
    expanded = Path(path).expanduser()
    if expanded.exists() and not expanded.is_dir():
        raise BenchError(f"{option} {path} is a file, not a folder; {writes} go in a folder: name a folder")
    ancestor = expanded.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BenchError(f"{option} {path}: {ancestor} is a file, not a folder")


def check_file_option(option: str, path: Path) -> None:
    """One line, before any work and creating nothing, for a file option (``--json``) that cannot be written: a
    folder, a symbolic link, a missing parent folder, no permission (the rule of ``slimkit eval --json``)."""
    from slimkit.primitives.files.guard import check_file_target

    try:
        check_file_target(option, Path(path))
    except SlimkitError as error:
        raise BenchError(str(error)) from None


def emit_json(result: dict[str, Any], path: Path | None, option: str) -> None:
    """Print ``result`` as JSON and, with ``path`` (checked before the work by :func:`check_file_option`), write it
    there through a hidden sibling renamed into place."""
    from slimkit.primitives.files.guard import write_text_file

    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        write_text_file(Path(path), text + "\n", option)


__all__ = [
    "MAX_YAML_BYTES",
    "OneLineParser",
    "check_file_option",
    "check_folder_option",
    "emit_json",
    "read_json_file",
    "read_yaml_file",
]
