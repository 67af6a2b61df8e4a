"""A run started by ``torchrun`` / ``accelerate launch``: joining the launched processes, and who writes.

Every process runs the whole recipe on the same seed (the compression stages are deterministic, so every process
holds the same model when a training stage starts); the training stages share each global batch among the
processes (:mod:`slimkit.primitives.finetune.recovery`). Only the main process (rank 0) claims, writes and publishes
the output folder and the checkpoints, evaluates and shows progress; the others compute and read the checkpoints to
resume. The process group and each process's device come from accelerate's ``PartialState`` (the launcher's
environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``; gloo on CPU, NCCL on GPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Processes:
    """This process's place among the launched ones."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_world() -> int:
    """Processes the launcher started (1 outside a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def join_processes() -> Processes:
    """Join the launched processes (once; later calls return the same); a single process outside a launcher."""
    if launched_world() == 1:
        return Processes()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # accelerate joins CPU processes only when told
    return Processes(state.process_index, state.num_processes)


__all__ = ["Processes", "join_processes", "launched_world"]
