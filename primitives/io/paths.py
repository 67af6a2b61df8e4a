"""Paths as the Python API and the commands take them: their types, ``~`` expansion and the kernel's length limits.

* :func:`path_text` / :func:`as_path`: a ``str``, an ``os.PathLike`` or a ``bytes`` path (decoded as the file system
  does, ``os.fsdecode``) becomes text / a :class:`~pathlib.Path` with ``~`` / ``~user`` expanded; any other type, or
  a ``~user`` no account matches, is one :class:`SlimkitError` line naming the argument.
* :func:`as_names`: a list argument (datasets, tasks, overrides) given as a list or tuple of strings; a bare string
  is refused in one line instead of being iterated letter by letter.
* :func:`check_path_length`: a path to be written, and the longest path a command writes under it, fit the file
  system's ``PATH_MAX`` and every component its ``NAME_MAX`` (read with ``os.pathconf`` from the nearest existing
  folder), checked before any compute instead of failing when the result is saved.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slimkit.primitives.errors import SlimkitError

DEFAULT_PATH_MAX = 4096
"""The Linux ``PATH_MAX`` (bytes, the terminating NUL included), used where ``os.pathconf`` cannot tell."""
DEFAULT_NAME_MAX = 255
"""The longest file name (bytes) Linux and macOS file systems take, used where ``os.pathconf`` cannot tell."""
STAGING_NAME_BYTES = 48
"""Room a hidden staging sibling or lock adds to an output's own name (``.NAME.partial-<pid>-<token>``)."""


def path_text(value: Any, argument: str) -> str:
    """``value`` (``str``, ``os.PathLike`` or ``bytes``) as the text of a path, as given (``./x`` stays ``./x``) but
    with a leading ``~`` or ``~user`` expanded; one :class:`SlimkitError` line for another type, a NUL byte or a
    ``~user`` no account matches."""
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    elif isinstance(value, os.PathLike):
        value = os.fspath(value)
        value = os.fsdecode(value) if isinstance(value, bytes) else value
    if not isinstance(value, str):
        raise SlimkitError(f"{argument}: expected a path (str, os.PathLike or bytes), got {type(value).__name__}")
    if "\x00" in value:
        raise SlimkitError(f"{argument} {value!r}: a path cannot hold a NUL byte")
    if value.startswith("~"):
        user = value[1:].split("/", 1)[0]
        try:
            return str(Path(value).expanduser())
        except RuntimeError:
            who = f"no user named {user!r}" if user else "no home folder is known (HOME is unset)"
            raise SlimkitError(f"{argument} {value}: cannot expand ~{user}: {who}") from None
    return value


def as_path(value: Any, argument: str) -> Path:
    """:func:`path_text` as a :class:`Path`."""
    return Path(path_text(value, argument))


def as_names(value: Any, argument: str) -> list[str] | None:
    """A list argument given as a list or tuple of strings (None stays None); a bare string or another type is one
    line (a string would otherwise be read as a list of its letters)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise SlimkitError(f"{argument}: expected a list of strings, got the string {value!r}; write [{value!r}]")
    if not isinstance(value, Sequence) or not all(isinstance(item, str) for item in value):
        kinds = type(value).__name__ if not isinstance(value, Sequence) else "a list holding a non-string"
        raise SlimkitError(f"{argument}: expected a list of strings, got {kinds}")
    return list(value)


def _limits(path: Path) -> tuple[int, int]:
    """``(PATH_MAX, NAME_MAX)`` of the file system the nearest existing folder above ``path`` is on."""
    existing = path
    while existing != existing.parent:
        try:
            if existing.is_dir():
                break
        except OSError:  # a name too long to look up
            pass
        existing = existing.parent
    limits = []
    for name, default in (("PC_PATH_MAX", DEFAULT_PATH_MAX), ("PC_NAME_MAX", DEFAULT_NAME_MAX)):
        try:
            value = os.pathconf(existing, name)
        except (OSError, ValueError):
            value = -1
        limits.append(value if isinstance(value, int) and value > 0 else default)
    return limits[0], limits[1]


def check_path_length(argument: str, path: Path, inside: Sequence[str] = ()) -> None:
    """Refuse, before any work, a ``path`` to be written (with the relative paths in ``inside`` that a command writes
    under it) longer than the file system takes: the absolute path with a staging sibling's name, plus the longest
    inside path with its own, within ``PATH_MAX``; each component within ``NAME_MAX`` (the last one leaving room for
    the staging sibling's name)."""
    absolute = Path(os.path.abspath(path))
    path_max, name_max = _limits(absolute)
    parts = absolute.parts[1:]
    for index, part in enumerate(parts):
        room = name_max - (STAGING_NAME_BYTES if index == len(parts) - 1 else 0)
        size = len(os.fsencode(part))
        if size > room:
            raise SlimkitError(
                f"{argument}: the file name {part[:40]}... is {size} bytes; this file system takes {name_max}"
                + (
                    f", and a staging sibling needs {STAGING_NAME_BYTES} of them: use at most {room}"
                    if room < name_max
                    else ""
                )
            )
    # Written through a staging sibling (``.NAME.partial-...``), each inside file through its own staging sibling.
    longest = max((len(os.fsencode(name)) + 1 + STAGING_NAME_BYTES for name in inside), default=0)
    total = len(os.fsencode(str(absolute))) + STAGING_NAME_BYTES + longest + 1  # the terminating NUL
    if total > path_max:
        extra = total - 1 - len(os.fsencode(str(absolute)))
        what = f" and {extra} more are needed for its staging sibling" + (" and the files inside it" if inside else "")
        raise SlimkitError(
            f"{argument}: the path is {len(os.fsencode(str(absolute)))} bytes{what}, more than the {path_max} bytes "
            "(PATH_MAX) a path may take; choose a shorter one"
        )


__all__ = ["DEFAULT_NAME_MAX", "DEFAULT_PATH_MAX", "as_names", "as_path", "check_path_length", "path_text"]
