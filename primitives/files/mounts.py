"""Where file systems are mounted, and which paths name one file: what the kernel says, not path strings.

A path string does not say what it names: a bind mount (``mount --bind``, docker ``-v``) shows one folder under two
paths on the same file system, so both share a device number and ``os.path.ismount`` misses it. So:

* :func:`mount_table` reads the kernel's mount table (``/proc/self/mountinfo``): every mount point, its device
  and the folder of that device it shows (a bind mount shows a folder below the device's root);
* :func:`is_mount_point` asks the table, then ``os.path.ismount`` (which sees mounts of another device where
  there is no ``/proc``);
* :func:`aliases` lists every path the table shows one resolved path under (itself and its bind-mounted copies);
* :func:`identity` is a file's ``(st_dev, st_ino)``, the same under every alias and through hard links, and
  :func:`ancestor_identities` the identities of a path and of every folder above it, under every alias.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MOUNTINFO = Path("/proc/self/mountinfo")
MAX_MOUNTINFO_BYTES = 16 << 20
"""The most of the mount table read (a host with thousands of container mounts holds a few MiB)."""

Identity = tuple[int, int]
"""A file's ``(st_dev, st_ino)``."""


@dataclass(frozen=True)
class Mount:
    """One line of the mount table: ``device`` (``major:minor``) shows its folder ``root`` at ``point``."""

    device: str
    root: PurePosixPath
    point: PurePosixPath


def _unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    if "\\" not in field:
        return field
    raw = field.encode("utf-8", "surrogateescape")
    out, index = bytearray(), 0
    while index < len(raw):
        chunk = raw[index : index + 4]
        if len(chunk) == 4 and chunk[0:1] == b"\\" and chunk[1:].isdigit():
            out.append(int(chunk[1:], 8) & 0xFF)
            index += 4
        else:
            out.append(raw[index])
            index += 1
    return out.decode("utf-8", "surrogateescape")


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/PID/mountinfo`` text (malformed lines are skipped)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 5 or not fields[3].startswith("/") or not fields[4].startswith("/"):
            continue
        mounts.append(Mount(fields[2], PurePosixPath(_unescape(fields[3])), PurePosixPath(_unescape(fields[4]))))
    return mounts


def mount_table() -> list[Mount]:
    """The kernel's mount table for this process; empty where there is none (no ``/proc``: macOS)."""
    try:
        with open(MOUNTINFO, "rb") as handle:
            text = handle.read(MAX_MOUNTINFO_BYTES).decode("utf-8", "surrogateescape")
    except OSError:
        return []
    return parse_mountinfo(text)


def mount_points(table: list[Mount] | None = None) -> set[PurePosixPath]:
    """Every mount point in the table."""
    return {mount.point for mount in (mount_table() if table is None else table)}


def is_mount_point(path: str | os.PathLike, table: list[Mount] | None = None) -> bool:
    """Whether ``path`` (symbolic links resolved) is a mount point: in the kernel's table (bind mounts of the same
    file system included), or by ``os.path.ismount``."""
    resolved = Path(path).resolve()
    if PurePosixPath(resolved) in mount_points(table):
        return True
    try:
        return os.path.ismount(resolved)
    except OSError:
        return False


def mounts_inside(folder: str | os.PathLike, table: list[Mount] | None = None) -> list[PurePosixPath]:
    """The mount points strictly inside ``folder`` (resolved), sorted."""
    resolved = PurePosixPath(Path(folder).resolve())
    return sorted(point for point in mount_points(table) if point != resolved and point.is_relative_to(resolved))


def aliases(path: str | os.PathLike, table: list[Mount] | None = None) -> list[Path]:
    """Every path the mount table shows ``path`` (resolved) under: itself first, then its bind-mounted copies."""
    resolved = Path(path).resolve()
    table = mount_table() if table is None else table
    pure = PurePosixPath(resolved)
    holders = [mount for mount in table if pure.is_relative_to(mount.point)]
    found = [resolved]
    if not holders:
        return found
    holder = max(holders, key=lambda mount: len(mount.point.parts))  # the mount that shows this path
    inside = holder.root / pure.relative_to(holder.point)
    for mount in table:
        if mount.device == holder.device and inside.is_relative_to(mount.root):
            alias = Path(mount.point / inside.relative_to(mount.root))
            if alias not in found:
                found.append(alias)
    return found


def identity(path: str | os.PathLike, follow_symlinks: bool = True) -> Identity | None:
    """``path``'s ``(st_dev, st_ino)``, or None when it cannot be read."""
    try:
        status = os.stat(path, follow_symlinks=follow_symlinks)
    except (OSError, ValueError):
        return None
    return (status.st_dev, status.st_ino)


def ancestor_identities(path: str | os.PathLike, table: list[Mount] | None = None) -> set[Identity]:
    """The identities of ``path`` and of every folder above it, under each of its :func:`aliases`."""
    table = mount_table() if table is None else table
    found: set[Identity] = set()
    for alias in aliases(path, table):
        for folder in (alias, *alias.parents):
            ident = identity(folder)
            if ident is not None:
                found.add(ident)
    return found


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` resolved, or the nearest folder above it that exists (what an output not yet written is under)."""
    current = Path(path).expanduser().absolute()
    while not os.path.lexists(current) and current != current.parent:
        current = current.parent
    return current.resolve()


__all__ = [
    "Identity",
    "Mount",
    "aliases",
    "ancestor_identities",
    "identity",
    "is_mount_point",
    "mount_points",
    "mount_table",
    "mounts_inside",
    "nearest_existing",
    "parse_mountinfo",
]
