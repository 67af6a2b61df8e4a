"""Turning scores into kept indices."""

from __future__ import annotations

import math

import torch


def keep_count(width: int, remove_ratio: float, multiple: int = 1) -> int:
    """Units kept when ``remove_ratio`` of ``width`` is removed, rounded to ``multiple``; at least one multiple."""
    kept = width * (1.0 - remove_ratio)
    kept = round(kept / multiple) * multiple
    return max(multiple, min(width, kept))


def keep_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indices of the ``count`` highest scores (ties broken by lower index)."""
    if not 0 < count <= scores.numel():
        raise ValueError(f"cannot keep {count} of {scores.numel()} units")
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:count].sort().values


def units_to_remove(params_to_remove: float, params_per_unit: int) -> int:
    return math.ceil(params_to_remove / params_per_unit - 1e-9)


__all__ = ["keep_count", "keep_top", "units_to_remove"]
