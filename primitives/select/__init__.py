"""Turning scores into kept indices.

Pure selection rules (:mod:`.rules`), plans validated before anything changes (:mod:`.plan`) and iterative schedules
(:mod:`.iterative`).

Method note: docs/methods/selection.md.
"""

from __future__ import annotations

from slimkit.primitives.select.plan import (
    Fraction,
    SelectionRules,
    TargetOutOfReach,
    check_shapes,
    kept_counts,
    plan,
    solve_fraction,
    solve_target,
)
from slimkit.primitives.select.rules import (
    eligible_layers,
    global_keep,
    keep_count,
    keep_top,
    keep_top_per_block,
    min_kept,
    protect_lowest,
    round_kept,
)

__all__ = [
    "Fraction",
    "SelectionRules",
    "TargetOutOfReach",
    "check_shapes",
    "eligible_layers",
    "global_keep",
    "keep_count",
    "keep_top",
    "keep_top_per_block",
    "kept_counts",
    "min_kept",
    "plan",
    "protect_lowest",
    "round_kept",
    "solve_fraction",
    "solve_target",
]
