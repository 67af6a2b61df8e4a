"""Markdown table cells and lines, and plots, as every benchmark writes them.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MISSING = "-"


def cell(value: Any, spec: str = ".4g") -> str:
    """``value`` formatted with ``spec``; ``-`` for a missing or non-numeric value, a non-finite float as itself."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return MISSING
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def percent(value: Any, digits: int = 2) -> str:
    """A fraction as a percentage with ``digits`` decimals (``0.2 -> 20.00%``)."""
    return cell(value * 100, f".{digits}f") + "%" if isinstance(value, int | float) else MISSING


def line(cells: Sequence[str]) -> str:
    """One Markdown table line."""
    return "| " + " | ".join(cells) + " |"


def head(names: Sequence[str], align: str) -> list[str]:
    """A table's head line and separator; ``align`` has one letter per column: ``l`` (left) or ``r`` (right)."""
    return [line(names), "|" + "".join(" ---: |" if a == "r" else " --- |" for a in align)]


def pyplot() -> Any:
    """matplotlib's pyplot with the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series_color(plt: Any, index: int) -> Any:
    """Ten distinct hues first (tab20's dark shades), then their light shades."""
    return plt.get_cmap("tab20")((2 * index) % 20 + (index // 10) % 2)
