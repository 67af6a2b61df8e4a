"""How many whole experts a target removes, and whether whole experts can land on it at all: pure arithmetic on
shapes (one expert's parameters, what each layer may lose), known before any calibration.

``uniform`` removes the same count from every layer (``round(wanted / (expert_params x layers))``); ``global``
removes a total (``round(wanted / expert_params)``) spread over the layers by loss. Either lands on a multiple of its
step; a target between two multiples further than the tolerance from both cannot be met by whole experts.

Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertReach:
    """What the stage's rule removes for a target and how close whole experts come to it (parameters)."""

    count: int
    """Experts removed: per layer (uniform) or in all (global), as the stage's rule rounds."""
    most: int
    """The largest count the layers allow (each keeps its router's top-k)."""
    step: int
    """Parameters one more count removes (one expert, or one per layer)."""
    wanted: int
    slack: int

    @property
    def removed(self) -> int:
        return self.count * self.step

    @property
    def too_many(self) -> bool:
        """The count is more than the layers can lose."""
        return self.count > self.most

    @property
    def lands(self) -> bool:
        """The rule's removal is within the tolerance of the target and possible."""
        return not self.too_many and abs(self.removed - self.wanted) <= self.slack

    def nearest(self) -> tuple[int, ...]:
        """The removals (parameters) of the possible counts nearest the target on either side."""
        below = min(self.wanted // self.step, self.most)
        counts = sorted({below, min(below + 1, self.most)})
        return tuple(count * self.step for count in counts)


def expert_reach(wanted: int, expert_params: int, removable: Sequence[int], uniform: bool, slack: int) -> ExpertReach:
    """The experts a stage removes for ``wanted`` parameters and how close that lands. ``expert_params``: one
    expert's parameters (its slices and router row); ``removable``: each MoE layer's experts minus its top-k;
    ``uniform``: the same count from every layer; ``slack``: the tolerance in parameters."""
    if expert_params < 1 or not removable:
        raise ValueError("expert_reach needs a positive expert size and at least one MoE layer")
    step = expert_params * len(removable) if uniform else expert_params
    most = min(removable) if uniform else sum(removable)
    return ExpertReach(round(wanted / step), max(0, most), step, max(0, wanted), max(0, slack))


__all__ = ["ExpertReach", "expert_reach"]
