"""Replacing what slimkit writes in one step, and cleaning what a killed writer left.

Writing a folder or file ``NAME`` uses hidden siblings in the same parent folder:

* ``.NAME.partial-PID-XXXX``: built by process ``PID`` (:func:`staging_dir`, :func:`staging_file`), then
  renamed to ``NAME`` in one step;
* ``.NAME.replaced-PID-XXXX``: the previous ``NAME``, moved aside by :func:`swap_in` and then deleted.

A process that dies (``kill -9``, power loss) can leave these behind; :func:`remove_leftovers`
deletes those whose process is gone and never touches a live process's. The lock that keeps two
processes from writing one ``NAME`` is :mod:`slimkit.primitives.files.lock`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import tempfile
from pathlib import Path

from slimkit.primitives.files.removal import remove_owned


def staging_dir(target: Path) -> Path:
    """A new hidden sibling ``.NAME.partial-PID-XXXX`` of ``target`` to build it in before one atomic ``os.replace``.

    The creator's process id in the name lets :func:`remove_leftovers` tell a dead run's folder from a live one's.
    Created with the permissions a plain ``mkdir`` would give (``mkdtemp`` alone makes it 0700).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=_sibling_prefix(target, "partial"), dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    return path


def staging_file(target: Path) -> Path:
    """A new hidden, empty sibling file ``.NAME.partial-PID-XXXX`` of ``target`` to write before one atomic
    ``os.replace``.

    Created with the permissions a plain ``open`` would give (``mkstemp`` alone makes it 0600).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=_sibling_prefix(target, "partial"), dir=target.parent)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    path = Path(name)
    path.chmod(0o666 & ~umask)
    return path


def _sibling_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


MAX_PID = 4_194_304
"""The largest process id Linux hands out (``PID_MAX_LIMIT``); macOS stays below 100,000."""


def _leftover_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(target.name)}\.(partial|replaced)-([1-9]\d{{0,9}})-")


def leftover_pid(target: Path, name: str) -> tuple[str, int] | None:
    """``(kind, pid)`` when ``name`` is a hidden sibling slimkit writes beside ``target``
    (``.NAME.partial-PID-XXXX`` or ``.NAME.replaced-PID-XXXX``) with a process id no larger than :data:`MAX_PID`;
    None for any other name (a 20-digit number is no process id)."""
    match = _leftover_pattern(target).match(name)
    if match is None:
        return None
    pid = int(match[2])
    return (match[1], pid) if 0 < pid <= MAX_PID else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's process counts; so does an unreaped zombie)."""
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(target: Path, marker: str | None = None) -> list[str]:
    """Clean the hidden siblings of ``target`` that a dead process left; returns one line per thing done.

    A ``.NAME.partial-PID-*`` whose process is gone is deleted. A ``.NAME.replaced-PID-*`` whose process is gone
    is the previous result, moved aside just before the new one was renamed in: it is moved back to ``target``
    when ``target`` is missing (the process died between the two renames), else deleted (with ``marker``, the
    name of the marker such a result holds, only what that marker lists). Siblings of a live process (the
    caller's own included) and names without a process id in range (:func:`leftover_pid`) are left alone.
    Deleting goes through :func:`~slimkit.primitives.files.removal.remove_owned`: never across a mount, and what
    it leaves is named in the returned lines.
    """
    if not target.parent.is_dir():
        return []
    done = []
    for path in sorted(target.parent.iterdir()):
        parsed = leftover_pid(target, path.name)
        if parsed is None or pid_alive(parsed[1]):
            continue
        kind, pid = parsed
        if kind == "replaced" and not os.path.lexists(target):
            os.replace(path, target)
            done.append(f"restored {target} from {path.name}, the previous result a run (pid {pid}) left aside")
            continue
        listed = _marker_listing(path, marker) if kind == "replaced" else None
        left = remove_owned(path, listed)
        if left:
            done.append(
                f"kept {path.name} in {target.parent}, left by a run (pid {pid}) that did not finish: it holds "
                f"{left[0].phrase(path)}, which slimkit does not delete"
            )
        else:
            done.append(f"removed {path.name} in {target.parent}, left by a run (pid {pid}) that did not finish")
    return done


def _marker_listing(folder: Path, marker: str | None) -> set[str] | None:
    """What ``folder``'s ``marker`` lists; None without a marker name or a marker file; an unreadable marker lists
    nothing (so nothing inside is deleted)."""
    if marker is None or not os.path.lexists(folder / marker):
        return None
    from slimkit.primitives.errors import SlimkitError
    from slimkit.primitives.files.marker import read_marker

    try:
        return read_marker(folder, marker)
    except SlimkitError:
        return set()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_in(new: Path, target: Path) -> Path | None:
    """Put the folder ``new`` at ``target``; returns where the previous ``target`` now is (None: there was none).

    ``target`` always names a whole folder, the old or the new: on Linux the two are exchanged in one
    ``renameat2`` call; elsewhere the old one is renamed aside to ``.NAME.replaced-PID-XXXX`` and the new one
    renamed in (a process killed between the two leaves the old folder there, which :func:`remove_leftovers`
    moves back). The caller deletes the returned folder.
    """
    if not os.path.lexists(target):
        os.replace(new, target)
        return None
    aside = target.parent / f"{_sibling_prefix(target, 'replaced')}{secrets.token_hex(4)}"
    if _exchange(new, target):
        os.replace(new, aside)
    else:
        os.replace(target, aside)
        os.replace(new, target)
    return aside
