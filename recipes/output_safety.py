"""Output-folder safety: what a run may write, one run per folder, atomic publish, signals.

The output folder ``OUT`` (``--out``) is handled safely:

* it is checked before the model is loaded (:func:`check_output_dir`): never the filesystem root, the home
  folder, the working directory or one of its parents, nor the model it reads, a folder inside it or one holding
  it (:mod:`slimkit.primitives.files.guard`), nor a mount point (it could not be replaced in one rename); its
  parent must be writable; a non-empty ``OUT`` needs ``force``, which replaces only an earlier run's output:
  a folder holding :data:`RUN_MARKER` (written into every output just before it is published, listing what the
  run wrote) and nothing the marker does not list;
* one run at a time writes ``OUT``: the run holds the lock ``.OUT.lock`` beside it (:func:`claimed_output`);
  a second run fails at once, naming the first one's pid;
* everything is written to a hidden sibling ``.OUT.partial-PID-XXXX`` and put in place at the end in one step
  (:func:`publish`), so ``OUT`` always holds the whole old result or the whole new one; an interrupted run
  (Ctrl-C, or SIGTERM, which is handled like Ctrl-C) deletes its partial folder; those of killed runs are
  deleted by the next run to the same ``OUT``.

Test hook: ``SLIMKIT_TEST_PAUSE_AT`` (see :func:`pause_for_test`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import remove_leftovers, swap_in
from slimkit.primitives.files.guard import check_output_location
from slimkit.primitives.files.lock import LockHeld, acquire_lock
from slimkit.recipes.progress import Tracker

RUN_MARKER = ".slimkit-run.json"
"""The file a run writes into its output folder just before publishing it: the names it wrote (``files``)."""


def source_inputs(source: str) -> list[Path]:
    """What a run reading ``source`` reads from disk that its output must not overlap: a local model folder (a named
    source lives in the installed package or the cache)."""
    local = Path(source).expanduser()
    return [local] if local.exists() else []


def check_output_dir(out: Path, force: bool, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse, before anything is loaded or computed, an ``--out`` this run must not or cannot write.

    Never the filesystem root, the home folder, the working directory or one of its parents (see
    :func:`~slimkit.primitives.files.guard.protected_reason`), nor one of ``inputs`` (the model folder: itself,
    inside it or holding it), a symbolic link, a mount point or a file; the folder it is written in must be
    writable. A non-empty ``out`` needs ``force``, and ``force`` replaces only a run's output
    (:func:`check_replaceable`).
    """
    try:
        _check_output_path(out, force, inputs)
    except OSError as error:
        raise SlimkitError(f"--out {out}: cannot inspect it ({error.strerror})") from None


def _check_output_path(out: Path, force: bool, inputs: Iterable[str | os.PathLike]) -> None:
    check_output_location("--out", out, inputs, "a run")
    if out.exists() and not out.is_dir():
        raise SlimkitError(f"--out {out} exists and is not a directory")
    if out.is_dir() and os.path.ismount(out):
        raise SlimkitError(
            f"--out {out} is a mount point, which a run cannot replace in one rename; name a folder inside it"
        )
    check_writable(out, force)
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, force)


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


def written_by_run(folder: Path) -> set[str] | None:
    """The names ``folder``'s :data:`RUN_MARKER` lists (what a run wrote there), or None without a readable one."""
    marker = folder / RUN_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    return {str(name) for name in files} if isinstance(files, list) else None


def check_replaceable(out: Path, force: bool) -> None:
    """A non-empty ``out`` is replaced only with ``force`` and only when it is a run's output: it holds
    :data:`RUN_MARKER` and nothing the marker does not list (the user's own files are never replaced)."""
    if not force:
        raise SlimkitError(f"--out {out}: output directory exists and is not empty (use --force to replace it)")
    written = written_by_run(out)
    entries = sorted(entry.name for entry in out.iterdir() if entry.name != RUN_MARKER)
    if written is None:
        raise SlimkitError(
            f"--out {out} is not a slimkit output (it holds {entries[0] if entries else RUN_MARKER}, and no readable "
            f"{RUN_MARKER}); --force replaces only slimkit run outputs and empty folders"
        )
    other = [name for name in entries if name not in written]
    if other:
        raise SlimkitError(
            f"--out {out} holds {other[0]}, which slimkit did not write; --force replaces only a folder holding "
            "nothing but an earlier run's output"
        )


def write_run_marker(staging: Path) -> None:
    """Record in ``staging``'s :data:`RUN_MARKER` every name in it (what this run wrote)."""
    files = sorted(entry.name for entry in staging.iterdir() if entry.name != RUN_MARKER)
    record = {"written_by": "slimkit recipe run", "files": files}
    (staging / RUN_MARKER).write_text(json.dumps(record, indent=2) + "\n")


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
def claimed_output(
    out: Path, force: bool, tracker: Tracker, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[list[str]]:
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
            check_output_dir(out, force, inputs)
        except SlimkitError as error:
            raise SlimkitError(f"{error} ({'; '.join(notes)})" if notes else str(error)) from None
        yield notes
    finally:
        lock.release()


def checkpoint_root(out: Path) -> Path:
    """Where a run writing ``out`` keeps its training checkpoints: the hidden sibling ``.OUT.checkpoints`` (it must
    outlive a killed run, so it is neither inside the partial folder nor a leftover that the next run cleans); the
    run removes it once its output is published."""
    return out.parent / f".{out.name}.checkpoints"


def remove_checkpoints(out: Path) -> None:
    """Delete ``out``'s checkpoint root (after the output was published)."""
    shutil.rmtree(checkpoint_root(out), ignore_errors=True)


def publish(staging: Path, out: Path, force: bool) -> None:
    """Put the finished ``staging`` folder at ``out`` in one step, after checking ``out`` once more (something
    may have written there during the run); the previous result is deleted only once the new one is in place."""
    try:
        check_output_dir(out, force)
    except SlimkitError as error:
        raise SlimkitError(f"{error}; it changed while this run computed, so nothing was written") from None
    write_run_marker(staging)
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
