"""Turning scores into kept indices.

Rules (all pure functions on tensors, in :mod:`.rules`):

* :func:`keep_count`: units kept when a fraction is removed, rounded to a multiple, with a minimum.
* :func:`keep_top`: the highest-scoring units.
* :func:`keep_top_per_block`: the same number of top units inside each block (GQA parity: query
  heads are removed evenly from every KV group so the heads-per-KV-head ratio stays an integer).
* :func:`protect_lowest`: LoRAP's rule (Eq. 11): retain the least important ``fraction`` of units
  and remove the next-lowest ones instead, while the kept count still meets the budget.
* :func:`global_keep`: one threshold across several layers' scores, with a per-layer minimum.
* :func:`eligible_layers`: skip the first/last k layers.

Plans (in :mod:`.plan`): from scored groups and a budget to the kept units of every group.

* :class:`SelectionRules`: ``uniform`` or ``global`` mode, rounding multiples per group kind, the
  minimum kept units, LoRAP's protected fraction.
* :func:`kept_counts`: kept units per group for a removal fraction.
* :func:`check_shapes`: the rounding / minimum rules every group's shape must allow.
* :func:`solve_fraction`: the removal fraction that removes a wanted number of parameters of a part
  (``part`` is a recipe target name, ``model``/``layers``/``mlp``/``attention``, or a parameter-count
  name such as ``total``; see :data:`.plan.PART_NAMES`).
* :func:`solve_target`: the same within a tolerance, one fraction per kind when a coarse kind (GQA heads)
  jumps over the target; :class:`TargetOutOfReach` when no plan of the groups lands.
* :func:`plan`: kept unit indices for every group, validated before anything changes.

The plan module imports the rules from :mod:`.rules` (never from this package), so importing
either module first is safe.
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
