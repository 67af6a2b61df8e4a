"""Output-folder safety: what a run may write, one run per folder, atomic publish, signals.

Method note: docs/methods/output-safety.md.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from slimkit.engine.progress import Tracker
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import remove_leftovers, swap_in
from slimkit.primitives.files.guard import check_output_location
from slimkit.primitives.files.lock import claim_output
from slimkit.primitives.files.marker import check_only_listed, read_marker, write_marker
from slimkit.primitives.files.removal import remove_owned
from slimkit.primitives.files.writable import check_writable

RUN_MARKER = ".slimkit-run.json"
"""The file a run writes into its output folder just before publishing it: what it wrote (``files``, ``folders``)."""


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
    check_writable("--out", out, replace=force)
    if out.is_dir() and any(out.iterdir()):
        check_replaceable(out, force)


def written_by_run(folder: Path) -> set[str] | None:
    """The relative paths ``folder``'s :data:`RUN_MARKER` lists (what a run wrote there, at every depth), or None
    without a readable one (read with bounds: :func:`~slimkit.primitives.files.marker.read_marker`)."""
    try:
        return read_marker(folder, RUN_MARKER)
    except SlimkitError:
        return None


def check_replaceable(out: Path, force: bool) -> None:
    """A non-empty ``out`` is replaced only with ``force`` and only when it is a run's output: it holds
    :data:`RUN_MARKER` and nothing the marker does not list, at any depth (the user's own files are never
    replaced), and no mount point or other file system (:func:`~slimkit.primitives.files.removal.survey`)."""
    if not force:
        raise SlimkitError(f"--out {out}: output directory exists and is not empty (use --force to replace it)")
    try:
        written = read_marker(out, RUN_MARKER)
    except SlimkitError as error:
        entries = sorted(entry.name for entry in out.iterdir() if entry.name != RUN_MARKER)
        why = "" if not os.path.lexists(out / RUN_MARKER) else f": {error}"
        raise SlimkitError(
            f"--out {out} is not a slimkit output (it holds {entries[0] if entries else RUN_MARKER}, and no readable "
            f"{RUN_MARKER}{why}); --force replaces only slimkit run outputs and empty folders"
        ) from None
    check_only_listed(out, RUN_MARKER, written, "slimkit", "a folder holding nothing but an earlier run's output")


def write_run_marker(staging: Path) -> None:
    """Record in ``staging``'s :data:`RUN_MARKER` every file and folder in it, at every depth (what this run
    wrote)."""
    write_marker(staging, RUN_MARKER, {"written_by": "slimkit recipe run"})


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then raise them again (they act as usual): for steps never
    to be cut in two. Python handlers are swapped, not the signal mask: a signal sent to the process may land
    on any of its threads (torch's among them), and Python runs every handler in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []  # signal numbers
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not None]
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for number in received:
            signal.raise_signal(number)


@contextmanager
def claimed_output(
    out: Path, force: bool, tracker: Tracker, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[list[str]]:
    """Hold ``out``'s lock for the whole run (released however it ends); then clean what killed runs left
    beside ``out`` and check ``out`` again, now that no other run writes it. Yields the clean-up notes."""
    lock = claim_output(out, "run")
    try:
        notes = remove_leftovers(out, marker=RUN_MARKER)
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


def remove_checkpoints(out: Path) -> list[str]:
    """Delete ``out``'s checkpoint root (after the output was published) when slimkit created it, and the checkpoints
    slimkit wrote in it (:func:`~slimkit.primitives.finetune.checkpoint.remove_checkpoint_root`); one line per thing
    kept."""
    from slimkit.primitives.finetune.checkpoint import remove_checkpoint_root

    try:
        return remove_checkpoint_root(checkpoint_root(out))
    except OSError as error:
        return [f"kept {checkpoint_root(out)}: deleting it failed ({error.strerror or error})"]


def publish(staging: Path, out: Path, force: bool) -> list[str]:
    """Put the finished ``staging`` folder at ``out`` in one step, after checking ``out`` once more (something
    may have written there during the run); the previous result is deleted only once the new one is in place, and
    only what its marker lists (:func:`~slimkit.primitives.files.removal.remove_owned`). Returns a line for each
    thing it had to keep (the previous result's folder, beside ``out``)."""
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
        left = remove_previous(aside) if aside is not None else []
    return left


def remove_previous(aside: Path) -> list[str]:
    """Delete the previous output moved aside to ``aside`` (what its marker lists; an empty folder has none);
    one line when something had to stay."""
    listed = written_by_run(aside) or set()
    try:
        left = remove_owned(aside, listed)
    except OSError as error:
        return [f"kept the previous output in {aside}: deleting it failed ({error.strerror or error})"]
    if not left:
        return []
    return [f"kept the previous output in {aside}: it holds {left[0].phrase(aside)}, which slimkit does not delete"]
