"""A stage's arguments (:class:`StageArgs`, settings only) and the capabilities the recipe schema asks of them.

A capability is a small mixin an arguments class inherits only when its stage has it; the schema asks through
:func:`offered`, which answers with the capability's defaults (a stage that does none of it) otherwise:

* :class:`SharesTarget`: how the stage's share of the recipe's one target is set (``budget``);
* :class:`ChangesProjections`: the projections it needs plain, makes low-rank, rewrites, refits;
* :class:`ReadsData`: the calibration batches, the GLUE task, the reloaded dense model, held-out batches;
* :class:`ChecksRecipe`: its own check against the rest of the recipe.

What a run asks once a model is loaded (a planned removal, memory, layer statistics, model checks) is declared
beside the engine (:mod:`slimkit.engine.capabilities`). A stage that removes nothing and reads nothing needs none.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from slimkit.primitives.arch.view import LINEAR_ROLES, LinearRole
from slimkit.primitives.settings import Strict

if TYPE_CHECKING:  # the schema's Recipe names StageArgs in its own annotations; both are in this layer
    from slimkit.recipes.schema import Recipe

BudgetMode = Literal["none", "explicit", "solve", "layer"]
"""``none``: removes no parameters; ``explicit``: its own ratio, checked when the run ends; ``solve``: what is left of
the target; ``layer``: LoRAP's layer ratio from what is left of it."""
ALL_ROLES: frozenset[LinearRole] = frozenset(LINEAR_ROLES)
NO_ROLES: frozenset[LinearRole] = frozenset()


class StageArgs(Strict):
    """A stage's arguments: pydantic settings, one documented field each (the catalogue prints them)."""


class SharesTarget:
    """The stage removes parameters: its share of the recipe's one target."""

    def budget(self) -> BudgetMode:
        """How the stage's share of the recipe's target is set."""
        return "none"


class ChangesProjections:
    """The stage changes projections of the layers (what the schema checks across stages)."""

    def touches(self) -> frozenset[LinearRole]:
        """Projection roles the stage needs as plain ``Linear`` modules."""
        return NO_ROLES

    def makes_lowrank(self) -> frozenset[LinearRole]:
        """Projection roles the stage replaces by low-rank pairs."""
        return NO_ROLES

    def rewrites_kept(self) -> frozenset[LinearRole]:
        """Projection roles whose kept input columns the stage rewrites, not only slices (``obs_prune_layer``'s OBS
        update of ``down`` / ``o``): a later stage of its block that matches them to the dense columns cannot."""
        return NO_ROLES

    def refits(self) -> frozenset[LinearRole]:
        """Projection roles the stage refits from the block's dense snapshot, matching their kept columns to the
        dense ones (``reconstruct``)."""
        return NO_ROLES


class ReadsData:
    """The stage reads data beyond the model's weights."""

    calibration_depends_on: ClassVar[tuple[str, ...]] = ()
    """The arguments whose values decide :meth:`needs_calibration` (empty: the answer is the same for every value);
    ``slimkit stage show`` reads it to say when the stage reads calibration data."""

    def needs_calibration(self) -> bool:
        """Whether the stage reads calibration batches."""
        return False

    def needs_task(self) -> bool:
        """Whether the stage works on a GLUE task model (the recipe must name its ``task``)."""
        return False

    def reloads_dense(self) -> bool:
        """Whether the stage, at the top level of a recipe, loads the recipe's model source again (a distillation
        teacher, a refit target): a compressed model whose dense origin is missing is then refused before compute."""
        return False

    def holdout_batches(self) -> int:
        """Calibration batches the stage holds out from scoring (an allocation search's; 0: none)."""
        return 0


class ChecksRecipe:
    """The stage's arguments depend on the rest of the recipe."""

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """Raise ``ValueError`` (a validation message starting with ``where``, the stage's place in the recipe) when
        the rest of the recipe rules these arguments out; called when the recipe is validated."""
        return None


Capability = TypeVar("Capability")


def offered(args: object, capability: type[Capability]) -> Capability:
    """``args`` where its stage offers ``capability``, else the capability's defaults (a stage without it)."""
    return args if isinstance(args, capability) else capability()


__all__ = [
    "ALL_ROLES",
    "NO_ROLES",
    "BudgetMode",
    "ChangesProjections",
    "ChecksRecipe",
    "ReadsData",
    "SharesTarget",
    "StageArgs",
    "offered",
]
