"""A recovery run's checkpoint: everything the next step depends on, written atomically, read back to resume.

A checkpoint is a folder holding ``state.pt`` (``torch.save`` of plain tensors, numbers and dicts, read back with
``weights_only=True``): the optimizer's and scheduler's state or where they are, the steps done (the data position),
the random states (CPU, every CUDA device, Python's) and the curves so far. A replicated run's ``state.pt`` also holds
the trained tensors and the optimizer's state; a sharded run's holds only the trained tensors' names and shapes, and
every process writes its own shards of the weights and optimizer state beside it with ``torch.distributed.checkpoint``
(nothing is gathered). The folder is built in a hidden sibling, marked as slimkit's (:data:`CHECKPOINT_MARKER`
lists what it holds) and swapped in whole (:mod:`slimkit.primitives.files.atomic`), so a run killed while writing
leaves the previous checkpoint intact; only marked folders are deleted, only what their marker lists, never across a
mount (:mod:`slimkit.primitives.files.removal`).

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import remove_leftovers, staging_dir, swap_in
from slimkit.primitives.files.marker import read_marker, write_marker
from slimkit.primitives.files.removal import NOT_LISTED, Blocker, discard, remove_owned, survey
from slimkit.primitives.finetune.process_group import world

STATE_FILE = "state.pt"
SHARDS_DIR = "shards"
"""The sharded checkpoint's ``torch.distributed.checkpoint`` folder (one ``__RANK_*.distcp`` file per process)."""
SHARDED_KEY = "sharded"
"""The key of a sharded checkpoint's ``state.pt`` holding the trained tensors' shapes by name."""

CHECKPOINT_MARKER = ".slimkit-checkpoint.json"
"""The marker in every checkpoint folder slimkit writes, listing what it holds (what may be deleted)."""
ROOT_MARKER = ".slimkit-checkpoints.json"
"""The marker in a folder of checkpoints slimkit created (a run's ``.OUT.checkpoints``): only such a folder is
deleted when the run is done."""

Shapes = Mapping[str, tuple[int, ...]]


def _claim_parent(folder: Path) -> None:
    """Create ``folder``'s parent, marked as slimkit's, when it does not exist (an existing one is left as it is)."""
    parent = folder.parent
    if os.path.lexists(parent):
        return
    parent.parent.mkdir(parents=True, exist_ok=True)
    try:
        parent.mkdir()
    except FileExistsError:
        return
    write_marker(parent, ROOT_MARKER, {"written_by": "slimkit", "holds": "recovery checkpoints"})


def _mark(staging: Path) -> None:
    write_marker(staging, CHECKPOINT_MARKER, {"written_by": "slimkit recovery checkpoint"})


def _marked_listing(folder: Path) -> set[str]:
    """What ``folder``'s :data:`CHECKPOINT_MARKER` lists; nothing when it has no readable marker (kept whole)."""
    try:
        return read_marker(folder, CHECKPOINT_MARKER)
    except SlimkitError:
        return set()


def remove_checkpoint(folder: Path) -> list[Blocker]:
    """Delete the checkpoint folder at ``folder``: only what its marker lists, never across a mount (a folder
    without a readable marker, or anything but a folder, is left whole); returns what was left."""
    if not os.path.lexists(folder):
        return []
    if folder.is_symlink() or not folder.is_dir():
        return [Blocker(".", NOT_LISTED)]
    return remove_owned(folder, _marked_listing(folder))


_LEFTOVER = re.compile(r"^\.(.+)\.(?:partial|replaced)-[1-9]\d*-")


def remove_checkpoint_root(root: Path) -> list[str]:
    """Delete the checkpoints slimkit wrote in ``root`` (marked folders, only what their markers list, and what killed
    writers left beside them), then ``root`` itself when slimkit created it (it holds :data:`ROOT_MARKER`) and nothing
    else is left; one line per thing kept (``root`` when slimkit did not create it, anything slimkit did not write)."""
    if not os.path.lexists(root):
        return []
    if root.is_symlink() or not root.is_dir():
        return [f"kept {root}: it is not a folder slimkit made for checkpoints"]
    names = {match[1] if (match := _LEFTOVER.match(entry.name)) else entry.name for entry in root.iterdir()}
    for name in sorted(names - {ROOT_MARKER}):  # what killed writers left beside each checkpoint
        remove_leftovers(root / name, marker=CHECKPOINT_MARKER)
    kept: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.name == ROOT_MARKER:
            continue
        folder = entry.is_dir() and not entry.is_symlink()
        if folder and (entry / CHECKPOINT_MARKER).is_file():
            left = remove_checkpoint(entry)
        else:  # named by the first thing in it slimkit does not delete (a user's file, a mount point)
            left = (survey(entry, set()) if folder else []) or [Blocker(".", NOT_LISTED)]
        if left:
            kept.append(f"kept {left[0].phrase(entry)}: slimkit did not write it")
    marker = root / ROOT_MARKER
    if marker.is_symlink() or not marker.is_file():
        return [f"kept {root}: slimkit did not create it (no {ROOT_MARKER}); delete it yourself if it is not needed"]
    if kept:
        return kept
    return [f"kept {left[0].phrase(root)}" for left in [remove_owned(root, {ROOT_MARKER})] if left]


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hex key of named tensors' content (names, shapes, dtypes and bytes; one tensor on the CPU at a time)."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()[:32]


def model_content_key(folder: str | os.PathLike | None, model: nn.Module) -> str:
    """The content key a checkpoint is written for: the input model folder's
    (:func:`~slimkit.primitives.evaluate.reference.content_key`: every file's SHA-256, large ones remembered by their
    stamp), or for a model given in memory its weights' (:func:`tensors_digest`)."""
    from slimkit.primitives.evaluate.reference import content_key

    if folder is not None:
        return content_key(folder)
    return tensors_digest(model.state_dict().items())


def random_state() -> dict[str, Any]:
    """The random states a training step reads: torch's CPU generator, every CUDA device's, Python's."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(_python_state(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state(saved: Any) -> tuple:
    """Python's random state as ``random.setstate`` takes it (a saved tuple may come back as lists)."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def save_checkpoint(folder: Path, state: dict[str, Any]) -> None:
    """Write ``state`` as the checkpoint at ``folder``, replacing the previous one in one step."""
    _claim_parent(folder)
    remove_leftovers(folder, marker=CHECKPOINT_MARKER)
    staging = staging_dir(folder)
    try:
        torch.save(state, staging / STATE_FILE)
        _mark(staging)
        aside = swap_in(staging, folder)
    except BaseException:
        discard(staging)
        raise
    if aside is not None:
        remove_checkpoint(aside)


def _shared(value: str | None) -> str | None:
    """The main process's ``value`` on every process (a collective)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_sharded_checkpoint(folder: Path, state: dict[str, Any] | None, shards: dict[str, Any]) -> None:
    """Write a sharded checkpoint at ``folder``; every process calls it (a collective). Each process writes its own
    shards of ``shards`` (sharded state dicts: :func:`~slimkit.primitives.finetune.sharding.sharded_state`) into
    :data:`SHARDS_DIR`; the main process writes ``state`` (the small rest; None on the others) and swaps the folder
    in once every process has written. A failure on the main process is raised on every process (none waits)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank, _ = world()
    staging: Path | None = None
    problem: str | None = None
    if rank == 0:
        try:
            _claim_parent(folder)
            remove_leftovers(folder, marker=CHECKPOINT_MARKER)
            staging = staging_dir(folder)
        except Exception as error:
            problem = f"cannot write the recovery checkpoint {folder} ({_reason(error)})"
    shared = _shared(None if staging is None else str(staging))
    if shared is None:
        raise SlimkitError(problem or f"cannot write the recovery checkpoint {folder} (the main process failed)")
    staging = Path(shared)
    try:
        dcp.save(shards, checkpoint_id=staging / SHARDS_DIR)  # raises on every process when one fails
    except BaseException as error:
        if rank == 0:
            discard(staging)
        if isinstance(error, (Exception, CheckpointException)):  # a failed write (not an interrupt) is one line
            raise SlimkitError(f"cannot write the recovery checkpoint {folder} ({_reason(error)})") from error
        raise
    aside: Path | None = None
    if rank == 0:
        try:
            torch.save(state, staging / STATE_FILE)
            _mark(staging)
            aside = swap_in(staging, folder)
        except Exception as error:
            discard(staging)
            problem = f"cannot write the recovery checkpoint {folder} ({_reason(error)})"
        except BaseException:
            discard(staging)
            raise
    problem = _shared(problem)  # every process learns whether the main one swapped the folder in
    if problem is not None:
        raise SlimkitError(problem)
    if aside is not None:
        remove_checkpoint(aside)


def load_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's ``state.pt`` at ``folder``; None when there is none. A file that cannot be read is one error
    line. Every launched process calls it: the main one cleans what a killed writer left, then all read."""
    rank, size = world()
    if rank == 0:
        remove_leftovers(folder, marker=CHECKPOINT_MARKER)
    if size > 1:
        import torch.distributed as dist

        dist.barrier()
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise _unreadable(folder, path, error) from error


def _reason(error: BaseException) -> str:
    """``error`` in one short line: a collective's error (several lines, each process's traceback) by its last line,
    which names the error that started it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text[:300]


def _unreadable(folder: Path, path: Path, error: BaseException) -> SlimkitError:
    return SlimkitError(
        f"cannot read the recovery checkpoint {path} ({_reason(error)}); delete {folder} to start the recovery over"
    )


def load_sharded(folder: Path, shards: dict[str, Any]) -> None:
    """Read this process's shards of a sharded checkpoint at ``folder`` into ``shards`` (sharded state dicts, in
    place); every process calls it (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = folder / SHARDS_DIR
    try:
        dcp.load(shards, checkpoint_id=path)
    except (Exception, CheckpointException) as error:
        raise _unreadable(folder, path, error) from error


def shapes_of(tensors: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor by name (a sharded tensor's whole shape); what a checkpoint is checked against."""
    return {name: tuple(int(d) for d in tensor.shape) for name, tensor in tensors.items()}


def resume_problem(folder: Path, state: Mapping[str, Any], shapes: Shapes, sharded: bool) -> str | None:
    """Why this run cannot resume from ``state`` (a checkpoint's ``state.pt``), one line; None when it can.
    ``shapes``: this run's trained tensors by name; ``sharded``: whether this run writes sharded checkpoints."""
    start_over = f"delete {folder} to start the recovery over"
    if sharded and SHARDED_KEY not in state:
        return (
            f"the recovery checkpoint {folder} holds gathered weights (a replicated run's, or a sharded run's from an "
            f"earlier slimkit), not the per-process shards this sharded run resumes from; {start_over}"
        )
    if not sharded and "trained" not in state:
        return f"the recovery checkpoint {folder} is a sharded run's, and this run is not sharded; {start_over}"
    saved = state[SHARDED_KEY] if sharded else shapes_of(state["trained"])
    saved = {name: tuple(int(d) for d in shape) for name, shape in saved.items()}
    wanted = {name: tuple(shape) for name, shape in shapes.items()}
    if saved == wanted:
        return None
    differ = sorted(set(saved) ^ set(wanted)) or sorted(n for n in saved if saved[n] != wanted[n])
    first = differ[0]
    detail = f"{first}: saved {list(saved[first]) if first in saved else 'none'}, this run "
    detail += f"{list(wanted[first]) if first in wanted else 'none'}"
    return (
        f"the recovery checkpoint {folder} holds other trained tensors than this run ({len(differ)} differ; "
        f"{detail}); {start_over}"
    )


__all__ = [
    "CHECKPOINT_MARKER",
    "ROOT_MARKER",
    "SHARDED_KEY",
    "SHARDS_DIR",
    "STATE_FILE",
    "load_checkpoint",
    "load_sharded",
    "model_content_key",
    "random_state",
    "remove_checkpoint",
    "remove_checkpoint_root",
    "restore_random_state",
    "resume_problem",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "shapes_of",
    "tensors_digest",
]
