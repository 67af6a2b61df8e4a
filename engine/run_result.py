"""What a run is asked for besides its recipe (:class:`RunOptions`) and what it returns (:class:`Result`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimkit.engine.report import RunReport


@dataclass
class Result:
    """What a run returns: the compressed model, its tokenizer, the typed report, and the output folder."""

    model: Any
    tokenizer: Any
    report: RunReport
    out: Path | None = None


@dataclass(frozen=True)
class RunOptions:
    """How a run goes besides its recipe: evaluate at all, and compare with the dense model's metrics."""

    evaluate: bool = True
    compare_dense: bool = True
    """Put the dense model's metrics (same evaluation settings, computed once and cached) beside the run's."""


__all__ = ["Result", "RunOptions"]
