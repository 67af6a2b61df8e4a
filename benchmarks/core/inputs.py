"""What the benchmark tools read (grid files, kept recipes, reports, earlier results), with the bounds the ``slimkit``
CLI reads its inputs with: a FIFO, a huge or deeply nested file is one line, never a hang or a traceback.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.core.errors import BenchError
from slimkit.primitives.errors import SlimkitError

MAX_YAML_BYTES = 1 << 20
"""The largest grid or kept recipe file read (a grid is a few KiB)."""


def read_yaml_file(path: Path, what: str) -> Any:
    """The value of the YAML file ``path`` (``what`` names it in errors, e.g. "grid file"), read with the recipes'
    bounded loader."""
    from slimkit.primitives.io.folder import check_regular_file
    from slimkit.recipes.safe_yaml import load_yaml

    try:
        size = check_regular_file(Path(path)).st_size
        if size > MAX_YAML_BYTES:
            raise BenchError(f"{what} {path}: {size:,} bytes, more than the {MAX_YAML_BYTES >> 10} KiB it may hold")
        text = Path(path).read_text(encoding="utf-8")
        return load_yaml(text, str(path))
    except BenchError:
        raise
    except SlimkitError as error:
        raise BenchError(f"{what}: {error}") from None
    except UnicodeDecodeError as error:
        raise BenchError(f"{what} {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise BenchError(f"cannot read {what} {path}: {error.strerror or error}") from None


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (``what`` names it in errors, e.g. "--reuse"), read with bounds."""
    from slimkit.primitives.io.folder import read_json_object

    try:
        return read_json_object(Path(path))
    except SlimkitError as error:
        raise BenchError(f"{what}: {error}") from None
