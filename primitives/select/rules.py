"""Pure selection rules on tensors: turning scores into kept counts and indices.

Everything here is re-exported by :mod:`slimkit.primitives.select`; import it from there. The rules
live in their own module so :mod:`slimkit.primitives.select.plan` can import them while
``select/__init__`` re-exports the plan's names (no import cycle).
"""

from __future__ import annotations

import math

import torch

from slimkit.primitives.errors import SlimkitError


def min_kept(multiple: int, minimum: int) -> int:
    """The fewest units a rule may keep: ``minimum`` rounded up to the multiple."""
    return math.ceil(minimum / multiple) * multiple


def round_kept(count: float, width: int, multiple: int = 1, minimum: int = 1) -> int:
    """``count`` kept units rounded to ``multiple``, never below :func:`min_kept` nor above ``width``."""
    return max(min_kept(multiple, minimum), min(width, round(count / multiple) * multiple))


def keep_count(width: int, remove_ratio: float, multiple: int = 1, minimum: int = 1) -> int:
    """Units kept when ``remove_ratio`` of ``width`` is removed (see :func:`round_kept`)."""
    return round_kept(width * (1.0 - remove_ratio), width, multiple, minimum)


def keep_top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indices of the ``count`` highest scores (ties broken by lower index)."""
    if not 0 < count <= scores.numel():
        raise ValueError(f"cannot keep {count} of {scores.numel()} units")
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:count].sort().values


def keep_top_per_block(scores: torch.Tensor, blocks: int, count: int) -> torch.Tensor:
    """Keep ``count / blocks`` top units inside each of ``blocks`` equal consecutive blocks."""
    if scores.numel() % blocks or count % blocks:
        raise ValueError(f"{scores.numel()} units / keep {count} do not split evenly over {blocks} blocks")
    per_block, size = count // blocks, scores.numel() // blocks
    kept = [keep_top(scores[b * size : (b + 1) * size], per_block) + b * size for b in range(blocks)]
    return torch.cat(kept)


def protect_lowest(scores: torch.Tensor, count: int, fraction: float) -> torch.Tensor:
    """Keep ``count`` units: the lowest ``fraction`` of all units, then the highest-scoring rest.

    LoRAP (Eq. 11) retains the least important 1% of channels this way.
    """
    protected = min(math.ceil(fraction * scores.numel()), count) if fraction > 0 else 0
    ascending = torch.argsort(scores, stable=True)
    lowest = ascending[:protected]
    rest = scores.clone()
    rest[lowest] = -torch.inf
    top = torch.argsort(rest, descending=True, stable=True)[: count - protected]
    return torch.cat([lowest, top]).sort().values


def global_keep(scores: list[torch.Tensor], remove_ratio: float, minimum: int = 1) -> list[int]:
    """Per-layer kept counts for removing ``remove_ratio`` of all units by one global threshold."""
    total = sum(s.numel() for s in scores)
    to_remove = round(remove_ratio * total)
    pooled = torch.cat([s.detach().float().cpu() for s in scores])  # one number per unit: selection is CPU logic
    owner = torch.cat([torch.full((s.numel(),), i) for i, s in enumerate(scores)])
    kept = [s.numel() for s in scores]
    for index in torch.argsort(pooled, stable=True).tolist():
        if to_remove == 0:
            break
        layer = int(owner[index])
        if kept[layer] > minimum:
            kept[layer] -= 1
            to_remove -= 1
    return kept


def eligible_layers(num_layers: int, skip_first: int = 0, skip_last: int = 0) -> list[int]:
    """Layer indices left after skipping the first ``skip_first`` and last ``skip_last`` layers."""
    layers = list(range(skip_first, num_layers - skip_last))
    if not layers:
        raise SlimkitError(f"skip_first={skip_first} and skip_last={skip_last} leave none of {num_layers} layers")
    return layers


__all__ = [
    "eligible_layers",
    "global_keep",
    "keep_count",
    "keep_top",
    "keep_top_per_block",
    "min_kept",
    "protect_lowest",
    "round_kept",
]
