"""A recovery run's checkpoint: everything the next step depends on, written atomically, read back to resume.

A checkpoint is a folder holding ``state.pt`` (``torch.save`` of plain tensors, numbers and dicts, read back with
``weights_only=True``): the trained tensors by name, the optimizer's and the learning-rate scheduler's state, the
steps done (which is the data position: the windows consumed follow from it), the random states (CPU, every CUDA
device, Python's) and the curves so far. It is built in a hidden sibling and swapped in whole
(:mod:`slimkit.primitives.files.atomic`), so a run killed while writing leaves the previous checkpoint intact.

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import remove_leftovers, staging_dir, swap_in

STATE_FILE = "state.pt"


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
    remove_leftovers(folder)
    staging = staging_dir(folder)
    try:
        torch.save(state, staging / STATE_FILE)
        aside = swap_in(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def load_checkpoint(folder: Path, mmap: bool = False) -> dict[str, Any] | None:
    """The checkpoint at ``folder``; None when there is none. A file that cannot be read is one error line. ``mmap``:
    tensors read from the file as they are used (several processes of a machine share the pages)."""
    remove_leftovers(folder)
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:
        raise SlimkitError(
            f"cannot read the recovery checkpoint {path} ({type(error).__name__}: {error}); delete {folder} to "
            "start the recovery over"
        ) from error


def remove_checkpoint(folder: Path) -> None:
    """Delete the checkpoint at ``folder`` (a finished run's) and its parent when that is left empty."""
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent
    if parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()


__all__ = [
    "STATE_FILE",
    "load_checkpoint",
    "random_state",
    "remove_checkpoint",
    "restore_random_state",
    "save_checkpoint",
]
