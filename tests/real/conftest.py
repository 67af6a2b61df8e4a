"""The real-model tier: every test here uses a shipped model (smollm2-135m, minilm-l6) and is marked ``real``.

``make test`` runs it on the CPU; ``make test-fast`` and ``-m "not real"`` leave it out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import mark_folder


def pytest_collection_modifyitems(items):
    mark_folder(items, Path(__file__).parent, pytest.mark.real)
