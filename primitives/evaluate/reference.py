"""The dense model's metrics, measured once per model content and evaluation settings, then read from the cache.

Method note: docs/methods/output-safety.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimkit.primitives.datasets.data_paths import cache_root
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import staging_file
from slimkit.primitives.io.folder import read_json_object

CACHE_FOLDER = "dense-metrics"
CACHE_FORMAT = 2
"""The entry format; part of the key (format 1 keyed sources by file name, size and modification time)."""
MAX_ENTRY_BYTES = 1 << 20
"""The largest cache entry read (one holds a few metrics: well under a KiB)."""
HASH_CHUNK = 8 << 20
"""Bytes read per step while hashing a file."""
DIGEST_FOLDER = "file-digests"
"""Where large files' digests are remembered (under the cache's :data:`CACHE_FOLDER`)."""
MEMO_MIN_BYTES = 16 << 20
"""Files at least this large have their digest remembered under their :func:`file_stamp`; smaller ones are hashed."""


def file_digest(path: Path) -> str:
    """The SHA-256 of the regular file at ``path`` (symbolic links followed), read in chunks; opened without
    blocking and checked to be a regular file first, so a FIFO or device is refused, never read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SlimkitError(f"{path} is not a regular file")
        digest = hashlib.sha256()
        with os.fdopen(fd, "rb", closefd=False) as handle:
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def file_stamp(status: os.stat_result) -> list[int]:
    """What changes whenever a file's content can have changed: its device, inode, size, modification time and
    status-change time (``ctime``: set by the kernel on every write, rename or ``utime`` call, so tools that restore
    the modification time, ``touch -r``, ``tar``, ``rsync -a``, still change it)."""
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


def _digest_memo() -> Path | None:
    try:
        return cache_root() / CACHE_FOLDER / DIGEST_FOLDER
    except (SlimkitError, OSError):
        return None


def remembered_digest(path: Path, status: os.stat_result) -> str:
    """:func:`file_digest` of a file of at least :data:`MEMO_MIN_BYTES`, remembered in the cache folder under its
    :func:`file_stamp`: hashed again only when the stamp changed. Smaller files (and any memo problem) are hashed."""
    memo = _digest_memo() if status.st_size >= MEMO_MIN_BYTES else None
    if memo is None:
        return file_digest(path)
    stamp = file_stamp(status)
    entry = memo / f"{hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:32]}.json"
    stored, _problem = _read_entry(entry)
    digest = stored.get("sha256") if stored is not None and stored.get("stamp") == stamp else None
    if isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest):
        return digest
    digest = file_digest(path)
    if file_stamp(path.stat()) == stamp:  # unchanged while it was hashed
        with suppress(SlimkitError, OSError, ValueError):
            _write_entry(entry, {"path": os.path.abspath(path), "stamp": stamp, "sha256": digest})
    return digest


def content_fingerprint(folder: str | os.PathLike | None) -> list[list[Any]]:
    """``[name, size, sha256]`` of each regular file directly in ``folder`` (symbolic links followed; other kinds
    listed by name only, never read), sorted by name; empty when there is no folder. Large files' digests are
    remembered by :func:`remembered_digest`."""
    if folder is None or not Path(folder).is_dir():
        return []
    entries: list[list[Any]] = []
    for entry in sorted(Path(folder).iterdir()):
        try:
            status = entry.stat()
        except OSError:
            entries.append([entry.name, "unreadable"])
            continue
        if stat.S_ISREG(status.st_mode):
            entries.append([entry.name, status.st_size, remembered_digest(entry, status)])
        elif not stat.S_ISDIR(status.st_mode):
            entries.append([entry.name, "not a regular file"])
    return entries


def content_key(folder: str | os.PathLike) -> str:
    """A hex key of ``folder``'s content: the SHA-256 of its :func:`content_fingerprint` (every regular file directly
    in it, by name, size and SHA-256). What every cache and checkpoint keyed by a model is keyed by."""
    return hashlib.sha256(json.dumps(content_fingerprint(folder)).encode()).hexdigest()[:32]


MEASURE_VERSION = 2
"""Bumped when the same settings measure differently (2: perplexity windows start with the tokenizer's BOS where it
adds one), so no metric measured the old way is read back."""


def cache_key(identity: dict[str, Any]) -> str:
    keyed = {**identity, "measure_version": MEASURE_VERSION}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass
class CacheUse:
    """What the cache did for one comparison: ``cached`` (read from it) and notes for the report (an entry
    ignored, metrics not stored) when something in it could not be used."""

    cached: bool = False
    notes: list[str] = field(default_factory=list)


def _read_entry(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(object, None)`` for a readable entry, ``(None, why)`` for an unusable one, ``(None, None)`` when absent:
    a regular file, not a symbolic link, of at most :data:`MAX_ENTRY_BYTES`, holding bounded JSON."""
    try:
        status = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as error:
        return None, f"cannot read it ({error.strerror or error})"
    if stat.S_ISLNK(status.st_mode):
        return None, "it is a symbolic link"
    if not stat.S_ISREG(status.st_mode):
        return None, "it is not a regular file"
    if status.st_size > MAX_ENTRY_BYTES:
        return None, f"{status.st_size:,} bytes, more than the {MAX_ENTRY_BYTES >> 10} KiB an entry holds"
    try:
        return read_json_object(path), None
    except SlimkitError as error:
        return None, str(error).removeprefix(f"{path}: ")


def _entry_problem(path: Path, identity: Any) -> tuple[dict[str, float] | None, str | None]:
    """``(metrics, None)`` for a usable entry, ``(None, why)`` for an unusable one, ``(None, None)`` when absent."""
    stored, problem = _read_entry(path)
    if stored is None:
        return None, problem
    if stored.get("identity") != identity:
        return None, "it was stored for other settings"
    metrics = stored.get("metrics")
    if not isinstance(metrics, dict) or not metrics:
        return None, "it holds no mapping of metrics"
    for name, value in metrics.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            return None, f"metric {name!r} is {json.dumps(value)[:40]}, not a finite number"
    return {name: float(value) for name, value in metrics.items()}, None


@contextmanager
def kept_random_state() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's (CPU and CUDA) random state when the block ends."""
    import numpy

    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)


def _write_entry(path: Path, data: dict[str, Any]) -> None:
    """Write an entry atomically; an absent or regular-file ``path`` only (a planted link or FIFO is left alone)."""
    if os.path.lexists(path) and not stat.S_ISREG(path.lstat().st_mode):
        raise SlimkitError(f"{path} is not a regular file")
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True)
    partial = staging_file(path)
    try:
        partial.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(partial, path)
    finally:
        with suppress(OSError):
            partial.unlink()


def dense_metrics(
    identity: dict[str, Any], measure: Callable[[], dict[str, float]]
) -> tuple[dict[str, float], CacheUse]:
    """``(metrics, use)``: the metrics stored for ``identity`` (the source's content, placement and evaluation
    settings), else ``measure()``'s, stored for the next run. ``measure`` runs with the random state kept. No cache
    problem raises: it is noted in ``use.notes`` and the metrics are measured (and, where possible, stored)."""
    use = CacheUse()
    identity = json.loads(json.dumps({"format": CACHE_FORMAT, **identity}, default=str))
    try:
        path: Path | None = cache_root() / CACHE_FOLDER / f"{cache_key(identity)}.json"
    except (SlimkitError, OSError) as error:
        path = None
        use.notes.append(f"dense comparison measured, not cached: {error}")
    if path is not None:
        metrics, problem = _entry_problem(path, identity)
        if metrics is not None:
            use.cached = True
            return metrics, use
        if problem is not None:
            use.notes.append(f"dense comparison: cache entry {path} ignored ({problem}); measured again")
    with kept_random_state():
        metrics = measure()
    if path is not None:
        try:
            _write_entry(path, {"identity": identity, "metrics": metrics})
        except (SlimkitError, OSError, ValueError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            use.notes.append(f"dense comparison measured, not cached: cannot write {path} ({reason})")
    return metrics, use
