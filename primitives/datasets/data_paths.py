"""Where slimkit finds its shipped data and keeps its caches.

The repository's ``data/`` folder is installed as the ``slimkit.data`` package, so it sits next to
``slimkit/__init__.py`` in both an editable and a plain install. ``SLIMKIT_DATA_DIR`` overrides it,
``SLIMKIT_CACHE_DIR`` (default ``~/.cache/slimkit``) holds converted models, prepared task files, the dense
comparison's metrics and the ``datasets`` library's cache (:func:`datasets_cache`, so nothing is written under the
home folder when ``SLIMKIT_CACHE_DIR`` points elsewhere). A cache folder that cannot be made is one line naming it
and ``SLIMKIT_CACHE_DIR``.
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
    """The cache folder, created if missing; one :class:`SlimkitError` line when it cannot be."""
    setting = os.environ.get("SLIMKIT_CACHE_DIR")
    try:
        root = Path(setting).expanduser() if setting else Path.home() / ".cache" / "slimkit"
    except RuntimeError:  # ~user of no known user, or no home folder
        raise SlimkitError(
            f"cache folder: cannot expand {setting or '~'} (no such home folder); set SLIMKIT_CACHE_DIR to a folder"
        ) from None
    named = f"SLIMKIT_CACHE_DIR {root}" if setting else f"the cache folder {root} (SLIMKIT_CACHE_DIR unset)"
    if root.exists() and not root.is_dir():
        raise SlimkitError(f"{named} is not a folder; point SLIMKIT_CACHE_DIR at a folder slimkit may write")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SlimkitError(
            f"{named} cannot be created ({error.strerror or error}); set SLIMKIT_CACHE_DIR to a writable folder"
        ) from None
    return root


def datasets_cache() -> Path:
    """Where the ``datasets`` library keeps its Arrow files for slimkit: ``cache_root() / "datasets"``."""
    folder = cache_root() / "datasets"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as error:
        raise SlimkitError(
            f"the datasets cache {folder} cannot be created ({error.strerror or error}); set SLIMKIT_CACHE_DIR to a "
            "writable folder"
        ) from None
    return folder
