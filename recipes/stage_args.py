"""The base of every stage's arguments: :class:`StageArgs`.

Besides its fields, a stage's argument model says what the recipe checks need before any compute, as methods
(the defaults here fit a stage that removes nothing, reads no data and touches no projection):

* :meth:`~StageArgs.budget`: how the stage's share of the recipe's one target is set: ``none`` (it removes no
  parameters), ``explicit`` (its own ``ratio``; the result is checked against the target at the end), ``solve`` (it
  removes what is left of the target when it starts, minus what the other stages of its ``sequential`` block plan to
  remove) or ``layer`` (LoRAP's rule: every layer's sub-layers lose the same fraction, computed from what is left of
  the target when its block starts).
* :meth:`~StageArgs.plan`: parameters of the target's part the stage will remove, computed from shapes before it
  runs (an ``explicit`` or ``layer`` stage whose removal does not depend on data; 0 otherwise); a ``solve`` stage in
  the same ``sequential`` block subtracts it.
* :meth:`~StageArgs.touches`: projection roles (q, k, v, o, gate, up, down) the stage needs as plain ``Linear``
  modules; :meth:`~StageArgs.makes_lowrank`: roles it replaces by low-rank pairs. A stage touching a role an earlier
  stage made low-rank is refused at validation.
* :meth:`~StageArgs.layer_grams` and :meth:`~StageArgs.dense_targets`: what a layer stage reads from the block's
  statistics pass (see :mod:`slimkit.recipes.layerwise`).
* :meth:`~StageArgs.needs_calibration`, :meth:`~StageArgs.needs_task`: the data the stage reads.
* :meth:`~StageArgs.operations`: the kinds of change an architecture may refuse, which the default
  :meth:`~StageArgs.check_model` checks against the loaded model's spec.
* :meth:`~StageArgs.check_model`: what only the loaded model decides (its architecture, its layer count), refused
  in one line after loading and before calibration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from slimkit.primitives.arch.capabilities import check_operations
from slimkit.recipes.schema import Strict

if TYPE_CHECKING:
    from slimkit.recipes.context import Context

BudgetMode = Literal["none", "explicit", "solve", "layer"]
ALL_ROLES: frozenset[str] = frozenset({"q", "k", "v", "o", "gate", "up", "down"})
NO_ROLES: frozenset[str] = frozenset()


class StageArgs(Strict):
    """A stage's arguments and what they imply for the recipe checks (defaults: a stage that removes nothing)."""

    encoder_only: ClassVar[bool] = False
    """The stage acts on encoders (a post-norm stream or a GLUE task model) only: left out of the decoder support
    table (:mod:`slimkit.recipes.support_table`)."""

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
        ``stats["dense_consumers"]``: captured by the block's statistics pass, before any stage of the block changes
        the layer."""
        return NO_ROLES

    def dense_targets(self) -> frozenset[str]:
        """Projection roles whose inputs in the *dense* model a layer stage also needs (``reconstruct``'s ``target:
        dense``): a ``sequential`` block then carries a second activation stream through the dense layers and adds,
        per role, the cross term of dense and compressed inputs to ``stats["dense_consumers"]``."""
        return NO_ROLES

    def needs_calibration(self) -> bool:
        """Whether the stage reads calibration batches."""
        return False

    def needs_task(self) -> bool:
        """Whether the stage works on a GLUE task model (the recipe must name its ``task``)."""
        return False

    def operations(self) -> frozenset[str]:
        """The kinds of change the stage makes that an architecture may refuse (group kinds, ``hidden_projection``,
        ``hidden_masks``, ``blocks``: :data:`~slimkit.primitives.arch.capabilities.OPERATIONS`)."""
        return NO_ROLES

    def check_model(self, model: Any) -> None:
        """Raise :class:`~slimkit.primitives.errors.SlimkitError` (one line) when the loaded model cannot take these
        arguments; called after loading, before calibration. The default refuses the :meth:`operations` the
        model's architecture cannot take (:func:`~slimkit.primitives.arch.capabilities.check_operations`)."""
        check_operations(model, self.operations())


__all__ = ["ALL_ROLES", "NO_ROLES", "BudgetMode", "StageArgs"]
