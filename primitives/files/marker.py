"""The marker a command writes into a folder it creates, listing what it wrote, and how a marker is read.

A run's output holds ``.slimkit-run.json``, an hf export's folder ``.slimkit-export.json``. :func:`write_marker`
records every file (``files``) and every folder (``folders``) inside, at every depth, as relative POSIX paths, so
``--force`` deletes exactly what the command wrote (:mod:`slimkit.primitives.files.removal`) and refuses a folder
holding anything else, at any depth.

:func:`read_marker` reads one with bounds: never through a symbolic link, never a FIFO or a device, at most
:data:`MAX_MARKER_BYTES`, nested at most as deep as a model folder's JSON
(:func:`~slimkit.primitives.io.folder.read_json_object`); ``files`` and ``folders`` must be lists of relative
paths. A marker written before folders were listed names top-level entries only; what lies below them is then
not listed, so ``--force`` refuses it rather than guess.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.removal import NOT_LISTED, listing, survey

MAX_MARKER_BYTES = 4 << 20
"""The largest marker read (one lists a few hundred paths: a few KiB)."""
MAX_ENTRIES = 100_000
"""The most paths a marker may list."""


def write_marker(folder: Path, name: str, record: dict[str, Any]) -> None:
    """Write ``record`` plus the listing of everything now in ``folder`` (the marker itself left out) to
    ``folder / name``."""
    files, folders = listing(folder)
    files = [path for path in files if path != name]
    (folder / name).write_text(json.dumps({**record, "files": files, "folders": folders}, indent=2) + "\n")


def _paths(record: dict[str, Any], key: str, path: Path) -> set[str]:
    value = record.get(key, [])
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise SlimkitError(f"{path}: '{key}' is not a list of at most {MAX_ENTRIES:,} paths")
    found = set()
    for item in value:
        if not isinstance(item, str) or not item or "\x00" in item:
            raise SlimkitError(f"{path}: '{key}' holds {str(item)[:40]!r}, not a relative path")
        pure = PurePosixPath(item)
        if pure.is_absolute() or ".." in pure.parts or pure.as_posix() != item:
            raise SlimkitError(f"{path}: '{key}' holds {item[:80]!r}, not a plain relative path")
        found.add(item)
    return found


def lists_top_level_only(folder: Path, name: str) -> bool:
    """Whether ``folder``'s marker ``name`` was written before markers listed every depth (it has no ``folders``);
    False when it cannot be read."""
    try:
        return "folders" not in _read(folder / name)
    except SlimkitError:
        return False


def unlisted_hint(folder: Path, name: str) -> str:
    """What to add to a refusal naming a path the marker does not list: for a marker that lists top-level names
    only, that it cannot vouch for what lies below them."""
    if not lists_top_level_only(folder, name):
        return ""
    return f" ({name} was written by an earlier slimkit and lists top-level names only; delete the folder yourself)"


def check_only_listed(folder: Path, name: str, listed: set[str], writer: str, replaces: str) -> None:
    """One :class:`SlimkitError` line naming the first thing in ``folder`` that ``--force`` may not delete: an entry
    its marker ``name`` does not list (``listed``), at any depth, or a mount point or another file system
    (:func:`~slimkit.primitives.files.removal.survey`); ``writer`` (``slimkit``, ``slimkit export``) wrote the
    folder and ``--force`` replaces only ``replaces``."""
    blockers = survey(folder, listed)
    if not blockers:
        return
    first = blockers[0]
    if first.reason == NOT_LISTED:
        raise SlimkitError(
            f"--out {folder} holds {first.path}, which {writer} did not write; --force replaces only {replaces}"
            + unlisted_hint(folder, name)
        )
    raise SlimkitError(
        f"--out {folder} holds {first.path}, {first.reason}; --force never deletes across a file-system boundary: "
        "unmount it or move it out first"
    )


def _read(path: Path) -> dict[str, Any]:
    from slimkit.primitives.io.folder import read_json_object

    return read_json_object(path, max_bytes=MAX_MARKER_BYTES, follow_symlinks=False, what="a marker")


def read_marker(folder: Path, name: str) -> set[str]:
    """The relative paths ``folder``'s marker ``name`` lists (files and folders, the marker itself added), or one
    :class:`SlimkitError` line naming the marker and what is wrong with it."""
    path = folder / name
    if not os.path.lexists(path):
        raise SlimkitError(f"{path}: no such file")
    record = _read(path)
    if "files" not in record:
        raise SlimkitError(f"{path}: it lists no 'files'")
    return _paths(record, "files", path) | _paths(record, "folders", path) | {name}


__all__ = [
    "MAX_ENTRIES",
    "MAX_MARKER_BYTES",
    "check_only_listed",
    "lists_top_level_only",
    "read_marker",
    "unlisted_hint",
    "write_marker",
]
