"""The base of every stage's arguments: :class:`StageArgs`. Its methods say what the engine needs to know about a
stage before any compute (budget, planned removal, touched projections, data, memory, allocation pre-pass,
checks); the engine never tests a stage's name or its arguments' class.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from slimkit.primitives.arch.capabilities import check_operations
from slimkit.primitives.settings import Strict

if TYPE_CHECKING:
    from slimkit.engine.allocation_prepass import PrePass
    from slimkit.engine.context import Context
    from slimkit.engine.stage_memory import MemoryInputs
    from slimkit.primitives.device.memory_model import ModelShape, StageMemory
    from slimkit.recipes.schema import Recipe

BudgetMode = Literal["none", "explicit", "solve", "layer"]
ALL_ROLES: frozenset[str] = frozenset({"q", "k", "v", "o", "gate", "up", "down"})
NO_ROLES: frozenset[str] = frozenset()


class StageArgs(Strict):
    """A stage's arguments and what they imply for the recipe checks (defaults: a stage that removes nothing)."""

    encoder_only: ClassVar[bool] = False
    """The stage acts on encoders (a post-norm stream or a GLUE task model) only: left out of the decoder support
    table (:mod:`slimkit.engine.support_table`)."""

    calibration_depends_on: ClassVar[tuple[str, ...]] = ()
    """The arguments whose values decide :meth:`needs_calibration` (empty: the answer is the same for every value);
    ``slimkit stage show`` reads it to say when the stage reads calibration data."""

    def budget(self) -> BudgetMode:
        """How the stage's share of the recipe's target is set (``none``: it removes no parameters)."""
        return "none"

    def plan(self, ctx: Context) -> int:
        """Parameters of the target's part the stage will remove, known from shapes before it runs (0: none known)."""
        return 0

    def touches(self) -> frozenset[str]:
        """Projection roles the stage needs as plain ``Linear`` modules."""
        return NO_ROLES

    def makes_lowrank(self) -> frozenset[str]:
        """Projection roles the stage replaces by low-rank pairs."""
        return NO_ROLES

    def rewrites_kept(self) -> frozenset[str]:
        """Projection roles whose kept input columns the stage rewrites, not only slices (``obs_prune_layer``'s OBS
        update of ``down`` / ``o``): a later stage of its block that matches them to the dense columns cannot."""
        return NO_ROLES

    def refits(self) -> frozenset[str]:
        """Projection roles the stage refits from the block's dense snapshot, matching their kept columns to the
        dense ones (``reconstruct``)."""
        return NO_ROLES

    def layer_grams(self) -> frozenset[str]:
        """Projection roles (``down``, ``o``) whose dense input Gram matrix and dense weight a layer stage reads from
        ``stats.dense_consumers``: captured by the block's statistics pass, before any stage of the block changes
        the layer."""
        return NO_ROLES

    def dense_targets(self) -> frozenset[str]:
        """Projection roles whose inputs in the *dense* model a layer stage also needs (``reconstruct``'s ``target:
        dense``): a ``sequential`` block then carries a second activation stream through the dense layers and adds,
        per role, the cross term of dense and compressed inputs to ``stats.dense_consumers``."""
        return NO_ROLES

    def needs_calibration(self) -> bool:
        """Whether the stage reads calibration batches."""
        return False

    def needs_task(self) -> bool:
        """Whether the stage works on a GLUE task model (the recipe must name its ``task``)."""
        return False

    def needs_gradients(self) -> bool:
        """Whether the stage back-propagates the calibration loss through the model (a gradient scorer)."""
        return False

    def reloads_dense(self) -> bool:
        """Whether the stage, at the top level of a recipe, loads the recipe's model source again (a distillation
        teacher, a refit target): a compressed model whose dense origin is missing is then refused before compute."""
        return False

    def holdout_batches(self) -> int:
        """Calibration batches the stage holds out from scoring (an allocation search's; 0: none)."""
        return 0

    def operations(self) -> frozenset[str]:
        """The kinds of change the stage makes that an architecture may refuse (group kinds, ``hidden_projection``,
        ``hidden_masks``, ``blocks``: :data:`~slimkit.primitives.arch.capabilities.OPERATIONS`)."""
        return NO_ROLES

    def check_model(self, model: Any) -> None:
        """Raise :class:`~slimkit.primitives.errors.SlimkitError` (one line) when the loaded model cannot take these
        arguments; called after loading, before calibration. The default refuses the :meth:`operations` the
        model's architecture cannot take (:func:`~slimkit.primitives.arch.capabilities.check_operations`)."""
        check_operations(model, self.operations())

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """Raise ``ValueError`` (a validation message starting with ``where``, the stage's place in the recipe) when
        the rest of the recipe rules these arguments out; called when the recipe is validated."""
        return None

    def check_source(self, recipe: Recipe, source: dict[str, Any]) -> None:
        """Raise :class:`~slimkit.primitives.errors.SlimkitError` (one line) when the loaded source (``source``:
        its name, path and, for a slimkit output, ``compressed_from``) rules these arguments out; called after
        loading, before any compute."""
        return None

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The stage's peak beside the weights at the top level of a recipe, by part (default: nothing but the dense
        log-probabilities an allocation search holds)."""
        from slimkit.engine.stage_memory import ACTIVATION_ADVICE
        from slimkit.primitives.device.memory_model import StageMemory

        memory = StageMemory(stage, advice=ACTIVATION_ADVICE)
        held = inputs.log_prob_bytes(self.holdout_batches())
        if held:
            memory.parts["dense log-probs"] = held
        return memory

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        """Bytes of the matrices a layer stage holds for one layer inside a ``sequential`` block (0: none)."""
        return 0

    def allocation_prepass(self, ctx: Context, stage: str) -> PrePass | None:
        """The stage's part of a layer-wise block's allocation pre-pass, or None when it allocates nothing
        (:mod:`slimkit.engine.allocation_prepass`); ``stage`` is the stage's registered name."""
        return None

    def reach_check(self, stage: str) -> Callable[[Context], None] | None:
        """A check, on shapes alone, that the stage can reach its share of the target when it stands in a recipe's
        first block (raising one :class:`~slimkit.primitives.errors.SlimkitError` line), or None when there is none
        to make; run before calibration with the block started."""
        return None


__all__ = ["ALL_ROLES", "NO_ROLES", "BudgetMode", "StageArgs"]
