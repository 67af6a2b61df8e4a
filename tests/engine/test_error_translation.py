"""One error line for an out-of-memory error in a labelled step, and for a failed write of the output folder."""

from __future__ import annotations

import errno

import pytest
import torch

from slimkit.engine.error_translation import output_write_errors, run_errors
from slimkit.engine.progress import Timings
from slimkit.primitives.errors import SlimkitError


def test_out_of_memory_names_the_innermost_step():
    timings = Timings()
    with pytest.raises(SlimkitError) as raised, run_errors(timings), timings.stage("outer"), timings.stage("inner"):
        raise torch.OutOfMemoryError("CUDA out of memory")
    message = str(raised.value)
    assert message.startswith("inner ran out of GPU memory; lower calibration.batch_size") and "\n" not in message
    assert set(timings.stages) == {"outer", "inner"}


def test_out_of_memory_outside_every_step_is_left_as_it_is():
    timings = Timings()
    with timings.stage("load"):
        pass
    with pytest.raises(MemoryError), run_errors(timings):
        raise MemoryError()
    with pytest.raises(ValueError), run_errors(timings), timings.stage("load"):
        raise ValueError("not memory")


def test_a_failed_write_names_the_output_folder(tmp_path):
    with pytest.raises(SlimkitError, match=r"--out .*out"), output_write_errors(tmp_path / "out"):
        raise OSError(errno.ENOSPC, "No space left on device")
