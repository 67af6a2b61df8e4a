"""Where a command may write, and how it stops: the rules every slimkit command that writes follows
(``recipe run``, ``export``, ``eval --json``, ``slimkit.run``, ``slimkit.export``).

Method note: docs/methods/output-safety.md.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.mounts import ancestor_identities, identity, is_mount_point, mount_table, nearest_existing

NAME_MAX_BYTES = 255
"""The longest file name (one path component, in bytes) Linux and macOS file systems take."""


def check_path_name(option: str, path: Path) -> None:
    """One :class:`SlimkitError` line for a path no file system takes: a NUL byte, or a component longer than
    :data:`NAME_MAX_BYTES` bytes (checked before any work, not when the result is written)."""
    text = str(path)
    if "\x00" in text:
        raise SlimkitError(f"{option} {text!r}: a path cannot hold a NUL byte")
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX_BYTES:
            raise SlimkitError(
                f"{option} {part[:40]}...: a file name is at most {NAME_MAX_BYTES} bytes, this one "
                f"{len(os.fsencode(part))}"
            )


def protected_reason(out: Path) -> str | None:
    """Why ``out`` may never be an output, or None: it is the filesystem root, the home folder, the current working
    directory or a parent of it, by path or by identity (``(st_dev, st_ino)``: the same folder under a bind mount or
    a symbolic link counts)."""
    resolved = out.expanduser().resolve()
    out_id = identity(resolved)
    if resolved == Path(resolved.anchor) or (out_id is not None and out_id == identity(resolved.anchor)):
        return "the filesystem root"
    try:
        home = Path.home().resolve()
    except (RuntimeError, KeyError):  # no home folder known
        home = None
    if home is not None and (resolved == home or (out_id is not None and out_id == identity(home))):
        return "the home folder"
    try:
        cwd = Path.cwd().resolve()
    except FileNotFoundError:  # the working directory was deleted
        return None
    if resolved == cwd or (out_id is not None and out_id == identity(cwd)):
        return "the current working directory"
    if cwd.is_relative_to(resolved) or (out_id is not None and out_id in ancestor_identities(cwd)):
        return "a parent of the current working directory"
    return None


def overlap_reason(out: Path, inputs: Iterable[str | os.PathLike]) -> str | None:
    """Why ``out`` would overwrite an input, or None: it is one of ``inputs`` (files or folders), lies inside one, or
    is a folder holding one. Compared by identity (``(st_dev, st_ino)``) under every path the kernel's mount table
    shows them at, so a bind-mounted alias, a symbolic link or a hard link is the same input; inputs that do not
    exist are compared by resolved path."""
    expanded = out.expanduser()
    resolved = expanded.resolve()
    table = mount_table()
    out_id = identity(resolved)
    out_chain = ancestor_identities(nearest_existing(expanded), table)
    for source in inputs:
        source_path = Path(source).expanduser()
        read = source_path.resolve()
        read_id = identity(read)
        if resolved == read or (read_id is not None and read_id == out_id):
            return f"the input {source_path} itself"
        if resolved.is_relative_to(read) or (read_id is not None and read_id in out_chain):
            return f"inside the input {source_path}"
        if read.is_relative_to(resolved) or (out_id is not None and out_id in ancestor_identities(read, table)):
            return f"a folder holding the input {source_path}"
    return None


def check_not_input(option: str, out: Path, inputs: Iterable[str | os.PathLike]) -> None:
    """One :class:`SlimkitError` line when ``out`` (given as ``option``) overlaps an input (:func:`overlap_reason`)."""
    reason = overlap_reason(out, inputs)
    if reason is not None:
        raise SlimkitError(
            f"{option} {out} is {reason}; a command never writes over or into what it reads: choose another path"
        )


def write_failure(what: str, error: OSError) -> SlimkitError:
    """One line for a write that failed: ``what`` (``--json results.json``), the reason, the file."""
    where = f" ({error.filename})" if error.filename else ""
    reason = error.strerror or f"{error} (a full disk or a file-size limit)"
    return SlimkitError(f"{what}: cannot write it: {reason}{where}; nothing was replaced")


def write_text_file(path: Path, text: str, option: str) -> None:
    """Write ``text`` to ``path`` through a hidden sibling renamed into place (never through a symbolic link at
    ``path``); a failure is one :class:`SlimkitError` line (``option`` names the setting) and leaves ``path`` as
    it was."""
    from slimkit.primitives.files.atomic import staging_file

    staging = None
    try:
        staging = staging_file(path)
        with open(staging, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(staging, path)
    except OSError as error:
        raise write_failure(f"{option} {path}", error) from None
    finally:
        if staging is not None:
            staging.unlink(missing_ok=True)


def check_file_target(option: str, path: Path) -> None:
    """Refuse, before any work and creating nothing, a ``path`` a command would write one file at (``--json``): a
    name no file system takes, a symbolic link, a folder or other non-regular file, a missing or non-folder parent,
    or a place this process cannot write; an existing regular file there is replaced."""
    from slimkit.primitives.files.writable import check_writable
    from slimkit.primitives.io.paths import check_path_length

    check_path_name(option, path)
    check_path_length(option, path)
    if path.is_symlink():
        raise SlimkitError(f"{option} {path} is a symbolic link; slimkit never writes through one: name the file")
    if path.is_dir():
        raise SlimkitError(f"{option} {path}: is a folder; give a file path such as {path / 'results.json'}")
    if path.exists() and not path.is_file():
        raise SlimkitError(f"{option} {path} is not a regular file; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise SlimkitError(f"{option} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise SlimkitError(f"{option} {path}: {parent} is not a folder")
    check_writable(option, path, replace=True)


def check_output_location(option: str, out: Path, inputs: Iterable[str | os.PathLike], writer: str) -> None:
    """The checks every output path gets before any work (``writer``, e.g. "a run", names who writes it): a name
    file systems take, not a protected folder, not an input, a name of its own (not ``.`` or ``..``), not a
    symbolic link, not a mount point (by the kernel's mount table: bind mounts of the same file system included)."""
    check_path_name(option, out)
    reason = protected_reason(out)
    if reason is not None:
        raise SlimkitError(f"{option} {out} is {reason}, which {writer} never replaces; name a new file or folder")
    check_not_input(option, out, inputs)
    if out.name in ("", ".", ".."):
        raise SlimkitError(f"{option} {out}: end the path with the output's own name, not . or ..")
    if out.is_symlink():
        raise SlimkitError(
            f"{option} {out} is a symbolic link; slimkit never writes through one: name the file or folder itself"
        )
    if os.path.lexists(out) and is_mount_point(out):
        raise SlimkitError(
            f"{option} {out} is a mount point, which {writer} cannot replace in one rename; name a folder inside it"
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


__all__ = [
    "NAME_MAX_BYTES",
    "Terminated",
    "check_file_target",
    "check_not_input",
    "check_output_location",
    "check_path_name",
    "overlap_reason",
    "protected_reason",
    "terminate_as_interrupt",
    "write_failure",
    "write_text_file",
]
