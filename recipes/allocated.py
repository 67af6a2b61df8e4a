"""The allocation a block's pre-pass decided (:mod:`slimkit.recipes.allocation`), as the layer-wise stages read it:
kept units per layer and kind in the block's cache, each layer's fraction, and the report entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.select.plan import Fraction
from slimkit.recipes.context import Context

if TYPE_CHECKING:
    from slimkit.recipes.stages.selection import SelectionArgs


@dataclass
class LayerAllocation:
    """A stage's allocation for one block: kept units per layer and kind, and its report entry."""

    kept: dict[int, dict[str, int]]
    sizes: dict[int, dict[str, int]]
    report: dict = field(default_factory=dict)

    def fraction(self, layer: int) -> Fraction:
        """The layer's removal fraction per kind, which the uniform plan turns back into exactly the kept counts."""
        return {kind: 1.0 - kept / self.sizes[layer][kind] for kind, kept in self.kept[layer].items()}


def allocation_key(stage: str, args: SelectionArgs) -> str:
    return f"allocation:{stage}:{'+'.join(args.groups)}"


def allocated_fraction(ctx: Context, stage: str, args: SelectionArgs, layer: int) -> Fraction | None:
    """The layer's fraction from the block's allocation; None for a uniform allocation."""
    if args.allocation_settings() == "uniform":
        return None
    found = ctx.block_cache.get(allocation_key(stage, args))
    if found is None:
        raise SlimkitError(
            f"{stage}: allocation is decided in the pre-pass of a layer-wise block; run the stage through a recipe"
        )
    return found.fraction(layer)


def allocation_entry(ctx: Context, stage: str, args: SelectionArgs) -> dict | None:
    """The report entry of the block's allocation (None for uniform)."""
    if args.allocation_settings() == "uniform":
        return None
    found = ctx.block_cache.get(allocation_key(stage, args))
    return found.report if found is not None else None


__all__ = ["LayerAllocation", "allocated_fraction", "allocation_entry", "allocation_key"]
