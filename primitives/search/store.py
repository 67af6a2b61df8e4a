"""The library's store on disk: candidates and scores kept by content, so a second search costs no new compression.

Layout under the store's folder (by default ``cache_root()/search``): ``candidates/<key>.safetensors`` (one record:
tensors, and the rest as metadata with the SHA-256 of the tensors' bytes) and ``scores/<key>.json`` (one score).
The key of a candidate digests what it is computed from (:mod:`.digest`: the calibration tokens and the model up to
its layer, the candidate's name and the library's settings); the key of a score, the whole model, the held-out
batches and the candidate's key. An entry that cannot be read back whole (truncated, edited, not a regular file) is
ignored with a note and computed again; writes are atomic (a staging file renamed into place). A store of ``None``
keeps nothing.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from slimkit.primitives.datasets.data_paths import cache_root
from slimkit.primitives.files.atomic import staging_file
from slimkit.primitives.search.digest import update_with_tensors
from slimkit.primitives.search.record import CandidateRecord

FOLDER = "search"
MAX_SCORE_BYTES = 4096


def default_root() -> Path:
    """``cache_root()/search``."""
    return cache_root() / FOLDER


def _tensor_digest(record: CandidateRecord) -> str:
    digest = hashlib.sha256()
    update_with_tensors(digest, sorted(record.tensors.items()))
    return digest.hexdigest()


def _regular(path: Path) -> str | None:
    """None for a regular file; why not otherwise (absent files are reported by the caller)."""
    status = path.lstat()
    if stat.S_ISLNK(status.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(status.st_mode):
        return "it is not a regular file"
    return None


def _publish(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path) and _regular(path) is not None:
        return  # a planted link or folder is left alone (never written through)
    partial = staging_file(path)
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        with suppress(OSError):
            partial.unlink()


class LibraryStore:
    """Candidates and scores by key (see the module docstring); ``notes`` collects what was ignored and why."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.notes: list[str] = []

    def _path(self, kind: str, key: str, suffix: str) -> Path | None:
        return None if self.root is None else self.root / kind / f"{key}{suffix}"

    def has_candidate(self, key: str) -> bool:
        """Whether an entry for ``key`` is there (read it to know it is whole)."""
        path = self._path("candidates", key, ".safetensors")
        return path is not None and path.is_file() and not path.is_symlink()

    def read_candidate(self, key: str) -> CandidateRecord | None:
        path = self._path("candidates", key, ".safetensors")
        if path is None or not os.path.lexists(path):
            return None
        try:
            problem = _regular(path)
            if problem is None:
                with safe_open(str(path), "pt") as handle:
                    meta = handle.metadata() or {}
                    tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                record = CandidateRecord.from_metadata(meta["record"], tensors)
                if meta.get("sha256") != _tensor_digest(record):
                    problem = "its tensors do not match their recorded digest"
                else:
                    return record
        except Exception as error:  # a damaged file: any read or parse failure means "compute it again"
            problem = f"it cannot be read ({type(error).__name__}: {str(error)[:80]})"
        self.notes.append(f"search: the stored candidate {path.name} was ignored and computed again: {problem}")
        return None

    def write_candidate(self, key: str, record: CandidateRecord) -> None:
        path = self._path("candidates", key, ".safetensors")
        if path is None:
            return
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in record.tensors.items()}
        metadata = {"record": record.metadata(), "sha256": _tensor_digest(record)}
        _publish(path, lambda partial: save_file(tensors, str(partial), metadata=metadata))

    def read_score(self, key: str) -> float | None:
        path = self._path("scores", key, ".json")
        if path is None or not os.path.lexists(path):
            return None
        problem = _regular(path)
        if problem is None:
            try:
                if path.stat().st_size > MAX_SCORE_BYTES:
                    raise ValueError("too large")
                value = json.loads(path.read_text()).get("kl")
                if type(value) in (int, float) and math.isfinite(value) and value >= 0:
                    return float(value)
                problem = "it holds no finite, non-negative score"
            except (OSError, ValueError, AttributeError) as error:
                problem = f"it cannot be read ({type(error).__name__})"
        self.notes.append(f"search: the stored score {path.name} was ignored and measured again: {problem}")
        return None

    def write_score(self, key: str, value: float) -> None:
        path = self._path("scores", key, ".json")
        if path is not None:
            _publish(path, lambda partial: partial.write_text(json.dumps({"kl": value}) + "\n"))


__all__ = ["FOLDER", "LibraryStore", "default_root"]
