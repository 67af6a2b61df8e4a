"""Where slimkit finds its shipped data and keeps its caches; how it replaces what it writes.

The repository's ``data/`` folder is installed as the ``slimkit.data`` package, so it sits next to
``slimkit/__init__.py`` in both an editable and a plain install. ``SLIMKIT_DATA_DIR`` overrides it,
``SLIMKIT_CACHE_DIR`` (default ``~/.cache/slimkit``) holds converted models and prepared task files.

Writing a folder or file ``NAME`` uses hidden siblings in the same parent folder:

* ``.NAME.partial-PID-XXXX``: built by process ``PID`` (:func:`staging_dir`, :func:`staging_file`), then
  renamed to ``NAME`` in one step;
* ``.NAME.replaced-PID-XXXX``: the previous ``NAME``, moved aside by :func:`swap_in` and then deleted;
* ``.NAME.lock``: held (``flock``) by the one process writing ``NAME`` (:func:`acquire_lock`).

A process that dies (``kill -9``, power loss) can leave the first two behind; :func:`remove_leftovers`
deletes those whose process is gone and never touches a live process's.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

from slimkit.primitives.errors import SlimkitError


def data_root() -> Path:
    override = os.environ.get("SLIMKIT_DATA_DIR")
    if override:
        return Path(override).resolve()
    import slimkit.data

    return Path(next(iter(slimkit.data.__path__))).resolve()


def data_file(relative: str) -> Path:
    """Absolute path of a shipped data file; a clear error when it is missing or unreadable."""
    path = data_root() / relative
    if not path.is_file():
        raise SlimkitError(f"data file missing: {path} (set SLIMKIT_DATA_DIR to the folder holding the datasets)")
    if not os.access(path, os.R_OK):
        raise SlimkitError(f"data file unreadable: {path}")
    return path


def cache_root() -> Path:
    root = Path(os.environ.get("SLIMKIT_CACHE_DIR", Path.home() / ".cache" / "slimkit"))
    root.mkdir(parents=True, exist_ok=True)
    return root


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


def _leftover_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(target.name)}\.(partial|replaced)-(\d+)-")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's process counts; so does an unreaped zombie)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(target: Path) -> list[str]:
    """Clean the hidden siblings of ``target`` that a dead process left; returns one line per thing done.

    A ``.NAME.partial-PID-*`` whose process is gone is deleted. A ``.NAME.replaced-PID-*`` whose process is gone
    is the previous result, moved aside just before the new one was renamed in: it is moved back to ``target``
    when ``target`` is missing (the process died between the two renames), else deleted. Siblings of a live
    process (the caller's own included) and names without a process id are left alone.
    """
    if not target.parent.is_dir():
        return []
    pattern = _leftover_pattern(target)
    done = []
    for path in sorted(target.parent.iterdir()):
        match = pattern.match(path.name)
        if match is None or pid_alive(int(match[2])):
            continue
        kind, pid = match[1], match[2]
        if kind == "replaced" and not os.path.lexists(target):
            os.replace(path, target)
            done.append(f"restored {target} from {path.name}, the previous result a run (pid {pid}) left aside")
        else:
            _remove(path)
            done.append(f"removed {path.name} in {target.parent}, left by a run (pid {pid}) that did not finish")
    return done


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


class LockHeld(SlimkitError):
    """Another process holds the lock on ``target``; ``pid`` is the one it recorded (None if unreadable)."""

    def __init__(self, target: Path, pid: int | None) -> None:
        super().__init__(f"{target} is being written by another process (pid {pid if pid else 'unknown'})")
        self.target = target
        self.pid = pid


class SiblingLock:
    """An exclusive lock on writing ``target``: the open, ``flock``-ed file ``.NAME.lock`` beside it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    def release(self) -> None:
        """Delete the lock file, then let go of the lock (in that order, see :func:`acquire_lock`)."""
        if self.fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = -1


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote in it (it writes just after locking: allow it a moment), or None."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.01)
    return None


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a releasing holder may have deleted it)."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


_LOCK_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _open_lock_file(path: Path) -> int:
    """The lock file, created with ``O_EXCL`` or, when one is there, opened without following a symbolic link; an
    existing one is taken over only when it is what a lock is (a regular file with one link holding a process id or
    nothing), so a file of the user's named like the lock is never truncated."""
    while True:
        try:
            return os.open(path, _LOCK_FLAGS | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, _LOCK_FLAGS)
            break
        except FileNotFoundError:  # its holder deleted it in between: create it again
            continue
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise SlimkitError(f"{path} is a symbolic link where slimkit keeps its lock; remove it") from None
            raise
    status = os.fstat(fd)
    text = os.pread(fd, 64, 0).decode(errors="replace").strip() if stat.S_ISREG(status.st_mode) else "?"
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1 or not (text == "" or text.isdigit()):
        os.close(fd)
        raise SlimkitError(f"{path} is not a slimkit lock file (it is named like one); move it away")
    return fd


def acquire_lock(target: Path) -> SiblingLock:
    """Claim ``target`` for this process: an exclusive, non-blocking ``flock`` on ``.NAME.lock`` beside it.

    The kernel drops the lock when its process dies, however it dies, so a lock file a killed run left is
    simply taken over. The holder's pid is written in the file for the message another process gets
    (:class:`LockHeld`). Creates ``target``'s parent folder if needed.
    """
    path = lock_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockHeld(target, holder) from None
        if _still_named(fd, path):
            break
        os.close(fd)  # locked a file its holder had just deleted: lock the current one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return SiblingLock(path, fd)
