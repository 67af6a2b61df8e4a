"""The one writability check of an output path (a run's folder, an export, a ``--json`` file): the folder it is
written in (its nearest existing ancestor: missing folders are created) must be a folder this process may write in,
and an output that will be replaced must itself be writable."""

from __future__ import annotations

import os
from pathlib import Path

from slimkit.primitives.errors import SlimkitError


def check_writable(option: str, path: Path, replace: bool = False) -> None:
    """Refuse in one line (``option`` names the setting) a ``path`` this process cannot write: its nearest existing
    ancestor is a file or not writable; with ``replace``, an existing ``path`` that is not writable itself."""
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SlimkitError(f"{option} {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SlimkitError(f"{option} {path}: no permission to write in {ancestor}")
    if replace and path.exists():
        kind, needed = ("folder", os.W_OK | os.X_OK) if path.is_dir() else ("file", os.W_OK)
        if not os.access(path, needed):
            raise SlimkitError(f"{option} {path}: no permission to replace it (the {kind} is not writable)")


__all__ = ["check_writable"]
