"""Where a command may write, and how it stops: the rules every slimkit command that writes follows
(``recipe run``, ``export``, ``eval --json``, ``slimkit.run``, ``slimkit.export``).

* Never a protected folder: the filesystem root, the home folder, the current working directory or a parent of
  it (:func:`protected_reason`).
* Never an input: an output that is an input of the command, lies inside one, or holds one is refused
  (:func:`overlap_reason`, :func:`check_not_input`), so no command replaces or writes into what it reads.
* SIGTERM is handled like Ctrl-C while a command writes (:func:`terminate_as_interrupt`): the command's
  ``finally`` blocks run, so its hidden partial file or folder and its lock are deleted on the way out.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slimkit.primitives.errors import SlimkitError


def protected_reason(out: Path) -> str | None:
    """Why ``out`` may never be an output, or None: it resolves to the filesystem root, the home folder, the
    current working directory or a parent of it."""
    resolved = out.expanduser().resolve()
    if resolved == Path(resolved.anchor):
        return "the filesystem root"
    try:
        if resolved == Path.home().resolve():
            return "the home folder"
    except (RuntimeError, KeyError):  # no home folder known
        pass
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:  # the working directory was deleted
        return None
    if resolved == cwd:
        return "the current working directory"
    if cwd.is_relative_to(resolved):
        return "a parent of the current working directory"
    return None


def overlap_reason(out: Path, inputs: Iterable[str | os.PathLike]) -> str | None:
    """Why ``out`` would overwrite an input, or None: it is one of ``inputs`` (files or folders, symbolic links
    resolved), lies inside one, or is a folder holding one."""
    resolved = out.expanduser().resolve()
    for source in inputs:
        source_path = Path(source).expanduser()
        read = source_path.resolve()
        if resolved == read:
            return f"the input {source_path} itself"
        if resolved.is_relative_to(read):
            return f"inside the input {source_path}"
        if read.is_relative_to(resolved):
            return f"a folder holding the input {source_path}"
    return None


def check_not_input(option: str, out: Path, inputs: Iterable[str | os.PathLike]) -> None:
    """One :class:`SlimkitError` line when ``out`` (given as ``option``) overlaps an input (:func:`overlap_reason`)."""
    reason = overlap_reason(out, inputs)
    if reason is not None:
        raise SlimkitError(
            f"{option} {out} is {reason}; a command never writes over or into what it reads: choose another path"
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM while a command writes, raised like Ctrl-C so the command cleans up before exiting."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While a command writes, SIGTERM raises :class:`Terminated` as Ctrl-C raises KeyboardInterrupt: only when the
    process has no SIGTERM handler of its own, and only in the main thread (where Python runs handlers)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _raise(_signum, _frame):
        raise Terminated("terminated (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["Terminated", "check_not_input", "overlap_reason", "protected_reason", "terminate_as_interrupt"]
