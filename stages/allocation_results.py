"""The allocation a block's pre-pass decided (:mod:`slimkit.engine.allocation_prepass`), as the layer-wise stages
read it from their own state: kept units per layer and kind (:class:`LayerAllocation`) and each layer's fraction; for
``lowrank``, the rank of every chosen matrix (:class:`RankAllocation`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.select.plan import Fraction
from slimkit.stages.selection import SelectionArgs


@dataclass
class LayerAllocation:
    """A stage's allocation for one block: kept units per layer and kind, and its report entry."""

    kept: dict[int, dict[str, int]]
    sizes: dict[int, dict[str, int]]
    report: dict = field(default_factory=dict)

    def fraction(self, layer: int) -> Fraction:
        """The layer's removal fraction per kind, which the uniform plan turns back into exactly the kept counts."""
        return {kind: 1.0 - kept / self.sizes[layer][kind] for kind, kept in self.kept[layer].items()}


class AllocatedState(Protocol):
    """The state of a selection stage whose pre-pass writes its allocation into it."""

    allocation: LayerAllocation | None


@dataclass
class RankAllocation:
    """A ``lowrank`` stage's global allocation for one block: the rank of each chosen matrix by layer and role (None:
    it stays dense), the parameters of the target's part they save, and the report entry."""

    ranks: dict[int, dict[str, int | None]]
    saved: int
    report: dict = field(default_factory=dict)


def allocated_fraction(
    stage: str, args: SelectionArgs, allocation: LayerAllocation | None, layer: int
) -> Fraction | None:
    """The layer's fraction from the block's allocation; None for a uniform allocation."""
    if args.allocation_settings() == "uniform":
        return None
    if allocation is None:
        raise SlimkitError(
            f"{stage}: allocation is decided in the pre-pass of a layer-wise block; run the stage through a recipe"
        )
    return allocation.fraction(layer)


__all__ = ["AllocatedState", "LayerAllocation", "RankAllocation", "allocated_fraction"]
