"""One writer per output: the ``flock``-ed hidden sibling ``.NAME.lock`` beside the ``NAME`` being written."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from slimkit.primitives.errors import SlimkitError


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
        if _is_pid_text(text):
            return int(text)
        time.sleep(0.01)
    return None


def _is_pid_text(text: str) -> bool:
    """A process id as a lock holds it: ASCII digits, at most 10 of them (``"²"`` is a digit to ``str.isdigit``
    but no number to ``int``)."""
    return text.isascii() and text.isdigit() and len(text) <= 10


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
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1 or not (text == "" or _is_pid_text(text)):
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


def claim_output(target: Path, writer: str) -> SiblingLock:
    """:func:`acquire_lock` for a command's ``--out``: a lock another ``writer`` (``run``, ``export``) holds, or a
    lock file that cannot be created, is one :class:`SlimkitError` line naming ``--out``."""
    try:
        return acquire_lock(target)
    except LockHeld as held:
        raise SlimkitError(
            f"--out {target} is being written by another slimkit {writer} (pid {held.pid or 'unknown'})"
        ) from None
    except OSError as error:
        raise SlimkitError(f"--out {target}: cannot create the lock file beside it ({error.strerror})") from None
