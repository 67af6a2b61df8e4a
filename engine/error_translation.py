"""Where an exception raised during a run becomes one error line (:class:`~slimkit.primitives.errors.SlimkitError`).

* Out of memory inside a labelled step of the run (a stage, or load / calibration / save / export / the dense
  comparison: :meth:`~slimkit.engine.progress.Timings.stage`): ``torch.OutOfMemoryError`` or the host's
  ``MemoryError`` becomes one line naming the step and what lowers the peak (:func:`run_errors`).
* A failed write of the output folder (a full disk, a file-size limit, a folder that became unwritable, met by
  Python or by safetensors) becomes one line naming ``--out``; nothing was replaced (:func:`output_write_errors`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError

from slimkit.engine.progress import Timings
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, GRADIENT_ADVICE
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.guard import write_failure

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)


def out_of_memory(label: str, error: BaseException) -> SlimkitError:
    """The one line for an out-of-memory ``error`` inside the step ``label``."""
    where = "GPU" if isinstance(error, torch.OutOfMemoryError) else "host"
    return SlimkitError(
        f"{label} ran out of {where} memory; {GRADIENT_ADVICE}, {ACTIVATION_ADVICE.split(' or ')[-1]}, "
        "or a smaller model.max_memory to offload layers (layer-wise stages)"
    )


@contextlib.contextmanager
def run_errors(timings: Timings) -> Iterator[None]:
    """Translate an out-of-memory error that left one of ``timings``' steps into one line naming that step (one
    raised outside every step is left as it is)."""
    try:
        yield
    except OOM_ERRORS as error:
        label = timings.step_of(error)
        if label is None:
            raise
        raise out_of_memory(label, error) from None


@contextlib.contextmanager
def output_write_errors(out_path: Path | None) -> Iterator[None]:
    """Translate a failed write of the run's output folder into one line naming ``--out``."""
    try:
        yield
    except OSError as error:  # a full disk, a file-size limit, a folder that became unwritable
        raise write_failure(f"--out {out_path}", error) from None
    except SafetensorError as error:  # the same, met while safetensors wrote the weights
        raise SlimkitError(f"--out {out_path}: cannot write the weights ({error}); nothing was replaced") from None


__all__ = ["OOM_ERRORS", "out_of_memory", "output_write_errors", "run_errors"]
