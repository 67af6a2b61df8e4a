"""Output-folder safety: what a run may write, one run per folder, atomic publish, signals.

The output folder ``OUT`` (``--out``) is handled safely:

* it is checked before the model is loaded (:func:`check_output_dir`): never the filesystem root, the home
  folder, the working directory or one of its parents; its parent must be writable; a non-empty ``OUT`` needs
  ``force``, which replaces only a slimkit output;
* one run at a time writes ``OUT``: the run holds the lock ``.OUT.lock`` beside it (:func:`claimed_output`);
  a second run fails at once, naming the first one's pid;
* everything is written to a hidden sibling ``.OUT.partial-PID-XXXX`` and put in place at the end in one step
  (:func:`publish`), so ``OUT`` always holds the whole old result or the whole new one; an interrupted run
  (Ctrl-C, or SIGTERM, which is handled like Ctrl-C) deletes its partial folder; those of killed runs are
  deleted by the next run to the same ``OUT``.

Test hook: ``SLIMKIT_TEST_PAUSE_AT`` (see :func:`pause_for_test`).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.save import MANIFEST_NAME
from slimkit.primitives.paths import LockHeld, acquire_lock, remove_leftovers, swap_in
from slimkit.recipes.progress import Tracker


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse, before anything is loaded or computed, an ``--out`` this run must not or cannot write.

    Never the filesystem root, the home folder, the working directory or one of its parents (see
    :func:`protected_reason`), nor a symbolic link or a file; the folder it is written in must be writable. A
    non-empty ``out`` needs ``force``, and ``force`` replaces only a slimkit output (:func:`is_slimkit_output`).
    """
    try:
        _check_output_path(out, force)
    except OSError as error:
        raise SlimkitError(f"--out {out}: cannot inspect it ({error.strerror})") from None


def _check_output_path(out: Path, force: bool) -> None:
    reason = protected_reason(out)
    if reason is not None:
        raise SlimkitError(f"--out {out} is {reason}, which a run never replaces; name a folder for its output")
    if out.name in ("", ".", ".."):
        raise SlimkitError(f"--out {out}: end the path with the output folder's own name, not . or ..")
    if out.is_symlink():
        raise SlimkitError(f"--out {out} is a symbolic link; name the folder itself, or a new one")
    if out.exists() and not out.is_dir():
        raise SlimkitError(f"--out {out} exists and is not a directory")
    check_writable(out, force)
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, force)


def protected_reason(out: Path) -> str | None:
    """Why ``out`` may never be a run's output folder, or None: it resolves to the filesystem root, the home
    folder, the current working directory or a parent of it."""
    resolved = out.resolve()
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


def check_writable(out: Path, force: bool) -> None:
    """The folder ``out`` is written in (its nearest existing ancestor) must be a folder this process may write
    in; an ``out`` that ``force`` will replace must be writable too."""
    ancestor = out.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SlimkitError(f"--out {out}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SlimkitError(f"--out {out}: no permission to write in {ancestor}")
    if force and out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise SlimkitError(f"--out {out}: no permission to replace it (the folder is not writable)")


def is_slimkit_output(folder: Path) -> bool:
    """Whether ``folder`` holds what slimkit writes: a run's output (``report.json`` or
    ``model/slimkit_manifest.json``) or a saved model (``slimkit_manifest.json``)."""
    return any((folder / name).is_file() for name in ("report.json", f"model/{MANIFEST_NAME}", MANIFEST_NAME))


def check_replaceable(out: Path, force: bool) -> None:
    """A non-empty ``out`` is replaced only with ``force`` and only when it is a slimkit output."""
    if not force:
        raise SlimkitError(f"--out {out}: output directory exists and is not empty (use --force to replace it)")
    if not is_slimkit_output(out):
        example = min(entry.name for entry in out.iterdir())
        raise SlimkitError(
            f"--out {out} is not a slimkit output (it holds {example}, and no report.json or "
            f"model/{MANIFEST_NAME}); --force replaces only slimkit outputs and empty folders"
        )


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run, raised like Ctrl-C so the run cleans up (partial folder, lock) before exiting."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While a run writes, SIGTERM raises :class:`Terminated` as Ctrl-C raises KeyboardInterrupt: only when the
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


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then raise them again (they act as usual): for steps never
    to be cut in two. Python handlers are swapped, not the signal mask: a signal sent to the process may land
    on any of its threads (torch's among them), and Python runs every handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not None]
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in received:
            signal.raise_signal(sig)


@contextmanager
def claimed_output(out: Path, force: bool, tracker: Tracker) -> Iterator[list[str]]:
    """Hold ``out``'s lock for the whole run (released however it ends); then clean what killed runs left
    beside ``out`` and check ``out`` again, now that no other run writes it. Yields the clean-up notes."""
    try:
        lock = acquire_lock(out)
    except LockHeld as held:
        raise SlimkitError(
            f"--out {out} is being written by another slimkit run (pid {held.pid or 'unknown'})"
        ) from None
    except OSError as error:
        raise SlimkitError(f"--out {out}: cannot create the lock file beside it ({error.strerror})") from None
    try:
        notes = remove_leftovers(out)
        for note in notes:
            tracker.log(note)
        try:
            check_output_dir(out, force)
        except SlimkitError as error:
            raise SlimkitError(f"{error} ({'; '.join(notes)})" if notes else str(error)) from None
        yield notes
    finally:
        lock.release()


def publish(staging: Path, out: Path, force: bool) -> None:
    """Put the finished ``staging`` folder at ``out`` in one step, after checking ``out`` once more (something
    may have written there during the run); the previous result is deleted only once the new one is in place."""
    try:
        check_output_dir(out, force)
    except SlimkitError as error:
        raise SlimkitError(f"{error}; it changed while this run computed, so nothing was written") from None
    aside = None
    try:
        with signals_deferred():
            aside = swap_in(staging, out)
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


PAUSE_AT = "SLIMKIT_TEST_PAUSE_AT"


def pause_for_test(point: str) -> None:
    """Test hook: with ``SLIMKIT_TEST_PAUSE_AT=point`` print ``slimkit: paused at POINT`` on stderr and sleep
    ``SLIMKIT_TEST_PAUSE_S`` seconds (default 60), so a test can signal the run at that moment. Points:
    ``compute`` (calibrated, before the stages run), ``save`` (the weights are written into the partial folder,
    the recipe and report not yet) and ``replace`` (the new output is complete in its partial folder, before it
    replaces ``out``)."""
    if os.environ.get(PAUSE_AT) != point:
        return
    print(f"slimkit: paused at {point}", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("SLIMKIT_TEST_PAUSE_S", "60")))
