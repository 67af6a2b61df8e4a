"""Where slimkit finds its shipped data and keeps its caches.

The repository's ``data/`` folder is installed as the ``slimkit.data`` package, so it sits next to
``slimkit/__init__.py`` in both an editable and a plain install. ``SLIMKIT_DATA_DIR`` overrides it,
``SLIMKIT_CACHE_DIR`` (default ``~/.cache/slimkit``) holds converted models and prepared task files.
"""

from __future__ import annotations

import os
from pathlib import Path

from slimkit.primitives.errors import SlimkitError


def data_root() -> Path:
    override = os.environ.get("SLIMKIT_DATA_DIR")
    if override:
        return Path(override).resolve()
    import slimkit.data

    return Path(next(iter(slimkit.data.__path__))).resolve()


def data_file(relative: str) -> Path:
    """Absolute path of a shipped data file; a clear error when it is missing or unreadable."""
    path = data_root() / relative
    if not path.is_file():
        raise SlimkitError(f"data file missing: {path} (set SLIMKIT_DATA_DIR to the folder holding the datasets)")
    if not os.access(path, os.R_OK):
        raise SlimkitError(f"data file unreadable: {path}")
    return path


def cache_root() -> Path:
    root = Path(os.environ.get("SLIMKIT_CACHE_DIR", Path.home() / ".cache" / "slimkit"))
    root.mkdir(parents=True, exist_ok=True)
    return root
