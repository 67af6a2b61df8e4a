"""A run started by ``torchrun`` / ``accelerate launch``: joining the launched processes, agreeing on the inputs, and
who writes.

Every process runs the whole recipe on the same seed (the compression stages are deterministic, so every process
holds the same model when a training stage starts); the training stages share each global batch among the
processes (:mod:`slimkit.primitives.finetune.recovery`). Only the main process (rank 0) claims, writes and publishes
the output folder and the checkpoints, evaluates and shows progress; the others compute and read the checkpoints to
resume. The process group and each process's device come from accelerate's ``PartialState`` (the launcher's
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``; gloo on CPU, NCCL on GPUs), every collective
bounded by :data:`COLLECTIVE_TIMEOUT_S`. Before any work the processes exchange a digest of their recipe, model and
data (:func:`agree_on_inputs`) and refuse together, in one line, when they differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from slimkit.primitives.errors import SlimkitError

COLLECTIVE_TIMEOUT_S = 1800
"""Seconds any collective waits for the other processes before it fails (the default; ``SLIMKIT_COLLECTIVE_TIMEOUT``
sets another): longer than the main process alone writes a checkpoint or evaluates."""


@dataclass(frozen=True)
class Processes:
    """This process's place among the launched ones."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


class ProcessesDisagree(SlimkitError):
    """Raised on every launched process at once; only the main process's is printed (``shown``)."""

    def __init__(self, message: str, shown: bool) -> None:
        super().__init__(message)
        self.shown = shown


def launched_world() -> int:
    """Processes the launcher started (1 outside a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def collective_timeout() -> timedelta:
    """How long a collective waits: ``SLIMKIT_COLLECTIVE_TIMEOUT`` seconds (a positive number), else
    :data:`COLLECTIVE_TIMEOUT_S`."""
    text = os.environ.get("SLIMKIT_COLLECTIVE_TIMEOUT")
    if text is None:
        return timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 10**7:
        raise SlimkitError(f"SLIMKIT_COLLECTIVE_TIMEOUT: {text!r} is not a number of seconds above 0")
    return timedelta(seconds=seconds)


def join_processes() -> Processes:
    """Join the launched processes (once; later calls return the same); a single process outside a launcher."""
    if launched_world() == 1:
        return Processes()
    import torch
    from accelerate import PartialState

    # accelerate joins CPU processes only when told; the timeout bounds every collective of the run
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=collective_timeout())
    return Processes(state.process_index, state.num_processes)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _data_of(recipe_dump: Any, corpora: set[str], folders: set[str]) -> None:
    """The shipped corpora (values naming one) and data folders (``data_folder`` values) a recipe reads."""
    from slimkit.primitives.datasets.textdata import CORPORA

    if isinstance(recipe_dump, dict):
        for key, value in recipe_dump.items():
            if key == "data_folder" and isinstance(value, str):
                folders.add(value)
            else:
                _data_of(value, corpora, folders)
    elif isinstance(recipe_dump, list):
        for value in recipe_dump:
            _data_of(value, corpora, folders)
    elif isinstance(recipe_dump, str) and recipe_dump in CORPORA:
        corpora.add(recipe_dump)


def _files_digest(files: list[Path], root: Path) -> list[list[Any]]:
    from slimkit.primitives.evaluate.reference import remembered_digest

    entries: list[list[Any]] = []
    for path in files:
        status = path.stat()
        entries.append([path.relative_to(root).as_posix(), status.st_size, remembered_digest(path, status)])
    return entries


def input_digests(recipe: Any, model: Any = None) -> dict[str, str]:
    """Short digests of what a run computes from: ``recipe`` (every field), ``model`` (the source folder's content,
    or a model given in memory: its weights), ``data`` (the shipped corpora and data folders the recipe names, by
    content) and ``slimkit`` (its version)."""
    from slimkit.primitives.datasets.data_paths import data_root
    from slimkit.primitives.datasets.textdata import CORPORA
    from slimkit.primitives.evaluate.reference import content_key
    from slimkit.primitives.finetune.checkpoint import tensors_digest
    from slimkit.primitives.finetune.token_stream import folder_files
    from slimkit.primitives.io.model_sources import resolve_source

    dump = recipe.model_dump(mode="json")
    if model is not None:
        model_key = tensors_digest(model.state_dict().items())
    else:
        model_key = content_key(resolve_source(recipe.model.source)[0])
    corpora: set[str] = set()
    folders: set[str] = set()
    _data_of(dump, corpora, folders)
    root = data_root()
    data: dict[str, Any] = {}
    for name in sorted(corpora):
        files = sorted({root / relative for relative in CORPORA[name].files.values()})
        data[name] = _files_digest([f for f in files if f.is_file()], root)
    for folder in sorted(folders):
        data[folder] = _files_digest(folder_files(folder), Path(folder))
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("slimkit")
    except PackageNotFoundError:
        installed = "source tree"
    return {"recipe": _digest(dump), "model": model_key[:16], "data": _digest(data), "slimkit": installed}


WHAT = {"recipe": "recipe", "model": "model's weights", "data": "data", "slimkit": "slimkit version"}


def disagreement(digests: list[dict[str, str]]) -> str | None:
    """The one line saying how the processes' :func:`input_digests` differ (None when they agree): the first part
    that differs and the ranks that differ from rank 0."""
    for part, what in WHAT.items():
        ranks = [rank for rank, mine in enumerate(digests) if mine.get(part) != digests[0].get(part)]
        if ranks:
            others = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(rank) for rank in ranks[:8])}"
            theirs, ours = digests[ranks[0]].get(part), digests[0].get(part)
            return (
                f"the {len(digests)} launched processes were given different inputs: the {what} of {others} differs "
                f"from rank 0's ({part} {theirs} against {ours}); launch every process with the same recipe, --set "
                "overrides, model and data, then run again"
            )
    return None


def agree_on_inputs(processes: Processes, recipe: Any, model: Any = None) -> None:
    """Exchange :func:`input_digests` among the launched processes before any work; on a difference every process
    raises :class:`ProcessesDisagree` with the same line (printed by the main one)."""
    if processes.world < 2:
        return
    import torch.distributed as dist

    gathered: list[Any] = [None] * processes.world
    with collective_errors(processes):
        dist.all_gather_object(gathered, input_digests(recipe, model))
    problem = disagreement(gathered)
    if problem is not None:
        with contextlib.suppress(Exception):  # a process exiting with its group still up aborts in gloo's threads
            dist.barrier()
            dist.destroy_process_group()
        raise ProcessesDisagree(problem, shown=processes.main)


@contextlib.contextmanager
def collective_errors(processes: Processes) -> Iterator[None]:
    """A collective that failed (it waited past the timeout, or another process went away) as one line naming this
    process; only launched processes are concerned."""
    try:
        yield
    except (RuntimeError, OSError) as error:
        import torch.distributed as dist

        if processes.world < 2 or not isinstance(error, (dist.DistError, RuntimeError)):
            raise
        text = " ".join(str(error).split())
        if not any(word in text for word in ("gloo", "NCCL", "Timed out", "timed out", "Connection", "collective")):
            raise
        raise SlimkitError(
            f"rank {processes.rank}: a collective among the {processes.world} launched processes failed "
            f"({text[:200]}); another process stopped, or waited longer than SLIMKIT_COLLECTIVE_TIMEOUT "
            f"({collective_timeout().total_seconds():.0f} s): see its own error line"
        ) from None


__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "Processes",
    "ProcessesDisagree",
    "agree_on_inputs",
    "collective_errors",
    "collective_timeout",
    "disagreement",
    "input_digests",
    "join_processes",
    "launched_world",
]
