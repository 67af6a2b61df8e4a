"""The GPU tier: every test here is marked ``gpu`` and skipped without CUDA (on a GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import mark_folder


def pytest_collection_modifyitems(items):
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    mark_folder(items, Path(__file__).parent, pytest.mark.gpu, needs_cuda)
