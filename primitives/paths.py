"""Where slimkit finds its shipped data and keeps its caches.

The repository's ``data/`` folder is installed as the ``slimkit.data`` package, so it sits next to
``slimkit/__init__.py`` in both an editable and a plain install. ``SLIMKIT_DATA_DIR`` overrides it,
``SLIMKIT_CACHE_DIR`` (default ``~/.cache/slimkit``) holds converted models and prepared task files.
"""

from __future__ import annotations

import os
import tempfile
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


def staging_dir(target: Path) -> Path:
    """A new hidden sibling of ``target`` to build it in before one atomic ``os.replace``.

    Created with the permissions a plain ``mkdir`` would give (``mkdtemp`` alone makes it 0700).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    return path


def staging_file(target: Path) -> Path:
    """A new hidden, empty sibling file of ``target`` to write before one atomic ``os.replace``.

    Created with the permissions a plain ``open`` would give (``mkstemp`` alone makes it 0600).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.partial-", dir=target.parent)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    path = Path(name)
    path.chmod(0o666 & ~umask)
    return path
