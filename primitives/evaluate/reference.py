"""The dense model's metrics, measured once per model source and evaluation settings, then read from the cache.

A run that compares its compressed model with the dense one (:func:`dense_metrics`) evaluates the dense model only
the first time: the metrics are stored under ``SLIMKIT_CACHE_DIR/dense-metrics/<key>.json``, the key a hash of the
source (its name, and the name, size and modification time of each file in its folder), the compute device type
and dtype, and the evaluation settings. The measurement keeps the random state of the run as it was (lm-eval seeds
Python's, NumPy's and torch's generators), so a cached and a measured comparison leave the same run behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from slimkit.primitives.data_paths import cache_root
from slimkit.primitives.files.atomic import staging_file

CACHE_FOLDER = "dense-metrics"


def source_fingerprint(folder: str | os.PathLike | None) -> list[list[Any]]:
    """Name, size and modification time of each file directly in ``folder`` (empty when there is none)."""
    if folder is None or not Path(folder).is_dir():
        return []
    return sorted(
        [entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
        for entry in Path(folder).iterdir()
        if entry.is_file()
    )


MEASURE_VERSION = 2
"""Bumped when the same settings measure differently (2: perplexity windows start with the tokenizer's BOS where it
adds one), so no metric measured the old way is read back."""


def cache_key(identity: dict[str, Any]) -> str:
    keyed = {**identity, "measure_version": MEASURE_VERSION}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:32]


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


def dense_metrics(identity: dict[str, Any], measure: Callable[[], dict[str, float]]) -> tuple[dict[str, float], bool]:
    """``(metrics, cached)``: the metrics stored for ``identity`` (the source, placement and evaluation settings),
    else ``measure()``'s, stored for the next run. ``measure`` runs with the random state kept."""
    path = cache_root() / CACHE_FOLDER / f"{cache_key(identity)}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("identity") == json.loads(json.dumps(identity, default=str)):
            return {k: float(v) for k, v in stored["metrics"].items()}, True
    except (OSError, ValueError, AttributeError, KeyError):
        pass  # not measured yet (or an unreadable entry, measured again)
    with kept_random_state():
        metrics = measure()
    partial = staging_file(path)
    partial.write_text(json.dumps({"identity": identity, "metrics": metrics}, indent=2, default=str) + "\n")
    os.replace(partial, path)
    return metrics, False
