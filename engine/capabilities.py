"""The capabilities a run asks of a stage's arguments once a model is known: small mixins an arguments class
inherits only where its stage has them (the engine asks through :func:`~slimkit.recipes.stage_args.offered`, which
answers with the defaults otherwise).

* :class:`PlansRemoval`: the parameters a fixed-budget stage will remove, known from shapes before it runs;
* :class:`PlansMemory`: its peak beside the weights (the recipe's memory plan, checked before loading);
* :class:`ReadsLayerStatistics`: what a layer stage reads of its block's statistics pass beyond the input norms;
* :class:`ChecksModel`: the kinds of change an architecture may refuse, and its checks of the loaded source and model;
* :class:`ChecksReach`: a refusal, on shapes alone, of a share it cannot reach (a stage in a recipe's first block).

What the recipe schema asks (budget mode, projections, data, recipe checks) is in :mod:`slimkit.recipes.stage_args`.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from slimkit.engine.context import Context
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, MemoryInputs
from slimkit.primitives.arch.capabilities import check_operations
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import ModelShape, StageMemory
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import ReadsData, offered


class PlansRemoval:
    """A stage with a fixed share (``budget`` ``explicit`` or ``layer``) says what it will remove."""

    def plan(self, ctx: Context) -> int:
        """Parameters of the target's part the stage will remove, known from shapes before it runs (0: none known)."""
        return 0


class PlansMemory:
    """The stage's memory beside the weights."""

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The stage's peak beside the weights at the top level of a recipe, by part (default: nothing but the dense
        log-probabilities an allocation search holds)."""
        return default_memory(self, stage, inputs)

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        """Bytes of the matrices a layer stage holds for one layer inside a ``sequential`` block (0: none)."""
        return 0


def memory_of(args: object, stage: str, inputs: MemoryInputs) -> StageMemory:
    """The stage's peak beside the weights: its own estimate where it plans memory, else :func:`default_memory`."""
    return args.memory(stage, inputs) if isinstance(args, PlansMemory) else default_memory(args, stage, inputs)


def default_memory(args: object, stage: str, inputs: MemoryInputs) -> StageMemory:
    """A stage's memory when it declares none: the dense log-probabilities its allocation search holds, if any."""
    memory = StageMemory(stage, advice=ACTIVATION_ADVICE)
    held = inputs.log_prob_bytes(offered(args, ReadsData).holdout_batches())
    if held:
        memory.parts["dense log-probs"] = held
    return memory


class ReadsLayerStatistics:
    """What a layer stage reads of its block's statistics pass beyond every projection's input norms."""

    def layer_grams(self) -> frozenset[LinearRole]:
        """Projection roles (``down``, ``o``) whose dense input Gram matrix and dense weight a layer stage reads from
        ``stats.dense_consumers``: captured by the block's statistics pass, before any stage of the block changes
        the layer."""
        return frozenset()

    def dense_targets(self) -> frozenset[LinearRole]:
        """Projection roles whose inputs in the *dense* model a layer stage also needs (``reconstruct``'s ``target:
        dense``): a ``sequential`` block then carries a second activation stream through the dense layers and adds,
        per role, the cross term of dense and compressed inputs to ``stats.dense_consumers``."""
        return frozenset()


class ChecksModel:
    """What the stage changes that an architecture may refuse, and its checks once the model is known."""

    encoder_only: ClassVar[bool] = False
    """The stage acts on encoders (a post-norm stream or a GLUE task model) only: left out of the decoder support
    table (:mod:`slimkit.engine.support_table`)."""

    def operations(self) -> frozenset[str]:
        """The kinds of change the stage makes that an architecture may refuse (group kinds, ``hidden_projection``,
        ``hidden_masks``, ``blocks``: :data:`~slimkit.primitives.arch.capabilities.OPERATIONS`)."""
        return frozenset()

    def check_model(self, model: Any) -> None:
        """Raise :class:`~slimkit.primitives.errors.SlimkitError` (one line) when the loaded model cannot take these
        arguments; called after loading, before calibration. The default refuses the :meth:`operations` the
        model's architecture cannot take (:func:`~slimkit.primitives.arch.capabilities.check_operations`)."""
        check_operations(model, self.operations())

    def check_source(self, recipe: Recipe, source: dict[str, Any]) -> None:
        """Raise :class:`~slimkit.primitives.errors.SlimkitError` (one line) when the loaded source (``source``:
        its name, path and, for a slimkit output, ``compressed_from``) rules these arguments out; called after
        loading, before any compute."""
        return None


class ChecksReach:
    """A stage whose share of the target depends on its units: refused on shapes alone when they cannot reach it."""

    def reach_check(self, ctx: Context, stage: str) -> None:
        """Raise one :class:`~slimkit.primitives.errors.SlimkitError` line when the stage (registered as ``stage``)
        cannot reach its share; run before calibration, with its block (a recipe's first) started."""
        return None


__all__ = [
    "ChecksModel",
    "ChecksReach",
    "PlansMemory",
    "PlansRemoval",
    "ReadsLayerStatistics",
    "default_memory",
    "memory_of",
]
