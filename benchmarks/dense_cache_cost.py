"""What keying the dense comparison's cache by content costs: the source folder hashed cold (no remembered digest)
and warm (every large file's digest remembered under its stamp), in seconds.

    python -m benchmarks.dense_cache_cost [--source smollm2-135m] [--repeats 3]

Prints one JSON object: the source, its bytes, and the cold and warm times of each repeat. The digests are remembered
in a temporary cache folder, so the user's cache is not touched (a named source is resolved, and converted on first
use, in the user's cache first). Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from slimkit.primitives.evaluate.reference import content_fingerprint
from slimkit.primitives.io.model_sources import resolve_source


def measure(folder: Path, repeats: int) -> dict[str, object]:
    """Cold and warm :func:`content_fingerprint` seconds of ``folder``, ``repeats`` times each."""
    cold: list[float] = []
    warm: list[float] = []
    fingerprint: list[list[Any]] = []
    previous = os.environ.get("SLIMKIT_CACHE_DIR")
    try:
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="dense-cache-cost-") as memo:
                os.environ["SLIMKIT_CACHE_DIR"] = memo
                start = time.perf_counter()
                fingerprint = content_fingerprint(folder)
                cold.append(round(time.perf_counter() - start, 4))
                start = time.perf_counter()
                assert content_fingerprint(folder) == fingerprint
                warm.append(round(time.perf_counter() - start, 4))
    finally:
        if previous is None:
            os.environ.pop("SLIMKIT_CACHE_DIR", None)
        else:
            os.environ["SLIMKIT_CACHE_DIR"] = previous
    size = sum(entry[1] for entry in fingerprint if isinstance(entry[1], int))
    return {"source": str(folder), "bytes": size, "cold_s": cold, "warm_s": warm}


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.dense_cache_cost", __doc__)
    parser.add_argument("--source", type=arg.model_source, default="smollm2-135m", help="a named source or a folder")
    parser.add_argument("--repeats", type=arg.integer(1), default=3, help="cold and warm measurements each")
    args = parser.parse(argv)
    folder, _info = resolve_source(args.source)
    print(json.dumps(measure(folder, args.repeats)))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
