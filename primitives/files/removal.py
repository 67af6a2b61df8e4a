"""The one way slimkit deletes a folder it wrote: never across a file-system boundary, only what it may delete.

Method note: docs/methods/output-safety.md.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from slimkit.primitives.files.mounts import Mount, mount_points, mount_table

MAX_DEPTH = 64
"""How deep a folder slimkit deletes may nest (an output nests 3 levels)."""

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class Blocker:
    """An entry the walk does not delete: ``path`` relative to the folder (``.`` for the folder), and why."""

    path: str
    reason: str

    def phrase(self, folder: Path) -> str:
        """``FOLDER/PATH (WHY)`` for an error line."""
        where = folder if self.path == "." else folder / self.path
        return f"{where} ({self.reason})"


NOT_LISTED = "not written by slimkit"
MOUNT_POINT = "a mount point"
OTHER_FILE_SYSTEM = "on another file system"


def listing(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Every file (anything not a folder, links included) and every folder inside ``folder``, at every depth, as
    sorted relative POSIX paths; symbolic links are not followed. What a marker records."""
    files: list[str] = []
    folders: list[str] = []
    root = Path(folder)
    for current, names, others in os.walk(root, followlinks=False):
        base = Path(current).relative_to(root)
        folders.extend((base / name).as_posix() for name in names)
        files.extend((base / name).as_posix() for name in others)
    return sorted(files), sorted(folders)


def survey(
    folder: str | os.PathLike, listed: Collection[str] | None = None, table: list[Mount] | None = None
) -> list[Blocker]:
    """What :func:`remove_owned` would leave in ``folder`` (nothing deleted): mounts, other file systems and, with
    ``listed``, every entry not in it. Empty when the whole folder would go."""
    return _walk(Path(folder), listed, delete=False, table=table)


def remove_owned(
    folder: str | os.PathLike, listed: Collection[str] | None = None, table: list[Mount] | None = None
) -> list[Blocker]:
    """Delete ``folder`` and what it holds as the module says (with ``listed``: only those relative paths);
    returns what was left. A missing ``folder`` is nothing to do; a file or link at ``folder`` is unlinked unless
    it is a mount point."""
    return _walk(Path(folder), listed, delete=True, table=table)


def discard(folder: str | os.PathLike) -> list[Blocker]:
    """:func:`remove_owned` for clean-up on the way out (a staging folder): an error while deleting (memory running
    out included) leaves the rest in place, for the next run's leftover clean-up, instead of masking what the caller
    raises."""
    try:
        return remove_owned(folder)
    except (OSError, MemoryError):
        return []


def _walk(folder: Path, listed: Collection[str] | None, delete: bool, table: list[Mount] | None) -> list[Blocker]:
    if not os.path.lexists(folder):
        return []
    if folder.is_symlink():  # never followed: the link itself goes
        if delete:
            os.unlink(folder)
        return []
    points = mount_points(mount_table() if table is None else table)
    real = PurePosixPath(folder.resolve())
    if real in points or os.path.ismount(folder):
        return [Blocker(".", MOUNT_POINT)]
    if not folder.is_dir():
        if delete:
            os.unlink(folder)
        return []
    blockers: list[Blocker] = []
    handle = os.open(folder, _DIR_FLAGS)
    try:
        device = os.fstat(handle).st_dev
        clean = _visit(handle, device, real, "", listed, delete, points, blockers, depth=1)
    finally:
        os.close(handle)
    if clean and delete:
        os.rmdir(folder)
    return blockers


def _visit(
    handle: int,
    device: int,
    real: PurePosixPath,
    relative: str,
    listed: Collection[str] | None,
    delete: bool,
    points: set[PurePosixPath],
    blockers: list[Blocker],
    depth: int,
) -> bool:
    """Delete (or look at) what the open folder ``handle`` holds; True when all of it went (or would go)."""
    clean = True
    with os.scandir(handle) as entries:
        children = sorted(entries, key=lambda entry: entry.name)
    for entry in children:
        name = entry.name
        path = f"{relative}/{name}" if relative else name
        status = entry.stat(follow_symlinks=False)
        if status.st_dev != device:
            blockers.append(Blocker(path, OTHER_FILE_SYSTEM))
            clean = False
            continue
        if real / name in points:
            blockers.append(Blocker(path, MOUNT_POINT))
            clean = False
            continue
        if not stat.S_ISDIR(status.st_mode):
            if listed is not None and path not in listed:
                blockers.append(Blocker(path, NOT_LISTED))
                clean = False
            elif delete:
                os.unlink(name, dir_fd=handle)
            continue
        if depth >= MAX_DEPTH:
            blockers.append(Blocker(path, f"nested more than {MAX_DEPTH} levels deep"))
            clean = False
            continue
        inner = os.open(name, _DIR_FLAGS, dir_fd=handle)
        try:
            opened = os.fstat(inner)
            if (opened.st_dev, opened.st_ino) != (status.st_dev, status.st_ino):
                blockers.append(Blocker(path, "changed while it was read"))
                clean = False
                continue
            inner_clean = _visit(inner, device, real / name, path, listed, delete, points, blockers, depth + 1)
        finally:
            os.close(inner)
        if not inner_clean:
            clean = False
        elif listed is not None and path not in listed:
            blockers.append(Blocker(path, NOT_LISTED))
            clean = False
        elif delete:
            os.rmdir(name, dir_fd=handle)
    return clean


__all__ = [
    "MAX_DEPTH",
    "MOUNT_POINT",
    "NOT_LISTED",
    "OTHER_FILE_SYSTEM",
    "Blocker",
    "discard",
    "listing",
    "remove_owned",
    "survey",
]
