"""Stage registry: the names a recipe's ``stage:`` field may use.

A stage is a function plus a pydantic model of its arguments (``extra="forbid"``, so a misspelt
argument fails with the allowed names) and a scope:

* ``layer``: ``fn(ctx, args, layer, stats)`` runs once per layer. At the top level of a recipe its
  statistics come from the dense model; inside ``sequential`` they come from the inputs produced by
  the already-compressed previous layers.
* ``model``: ``fn(ctx, args)`` runs once on the whole model.

A layer stage may also declare ``top_level``: its own whole-model form, which the runner calls when the stage
stands at the top level of a recipe (``reconstruct``).

What a stage declares besides its arguments, so a recipe is checked before any compute:

* ``budget(args)``: how the stage's share of the recipe's one target is set: ``none`` (it removes no
  parameters), ``explicit`` (its own ``ratio``; the result is checked against the target at the end),
  ``solve`` (it removes what is left of the target when it starts, minus what the other stages of its
  ``sequential`` block plan to remove) or ``layer`` (LoRAP's rule: every layer's sub-layers lose the
  same fraction, computed from what is left of the target when its block starts).
* ``plan(ctx, args)``: parameters of the target's part the stage will remove, computed from shapes
  before it runs (stages whose removal does not depend on data); a ``solve`` stage in the same
  ``sequential`` block subtracts it.
* ``touches(args)``: projection roles (q, k, v, o, gate, up, down) the stage needs as plain ``Linear``
  modules; ``makes_lowrank(args)``: roles it replaces by low-rank pairs. A stage touching a role an
  earlier stage made low-rank is refused at validation.
* ``once``: the reason a stage may appear only once in a recipe (a model is PCA-projected only once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

Scope = Literal["layer", "model"]
BudgetMode = Literal["none", "explicit", "solve", "layer"]
ALL_ROLES: frozenset[str] = frozenset({"q", "k", "v", "o", "gate", "up", "down"})


def _no_roles(_args: BaseModel) -> frozenset[str]:
    return frozenset()


@dataclass(frozen=True)
class StageDef:
    name: str
    args: type[BaseModel]
    scope: Scope
    fn: Callable[..., Any]
    summary: str
    needs_calibration: Callable[[BaseModel], bool]
    needs_task: bool = False
    """The stage works on a GLUE task model: the recipe must name its ``task``."""
    paper: str = ""
    """The paper section / equations the stage implements."""
    budget: Callable[[BaseModel], BudgetMode] = lambda _args: "none"
    plan: Callable[[Any, BaseModel], int] | None = None
    touches: Callable[[BaseModel], frozenset[str]] = _no_roles
    makes_lowrank: Callable[[BaseModel], frozenset[str]] = _no_roles
    once: str | None = None
    """Why the stage may appear only once in a recipe (None: any number of times)."""
    trains: bool = False
    """The stage takes gradient steps through the model (refused with float16 weights: without loss scaling
    float16 activations and gradients overflow or underflow; bfloat16 and float32 train)."""
    layer_grams: Callable[[BaseModel], frozenset[str]] = _no_roles
    """Projection roles (``down``, ``o``) whose dense input Gram matrix and dense weight a layer stage reads from
    ``stats["dense_consumers"]``: captured by the block's statistics pass, before any stage of the block changes
    the layer (see :mod:`slimkit.recipes.layerwise`)."""
    dense_targets: Callable[[BaseModel], frozenset[str]] = _no_roles
    """Projection roles whose inputs in the *dense* model a layer stage also needs (``reconstruct``'s ``target:
    dense``): a ``sequential`` block then carries a second activation stream through the dense layers and adds,
    per role, the cross term of dense and compressed inputs to ``stats["dense_consumers"]``."""
    top_level: Callable[[Any, BaseModel, int], None] | None = None
    """A layer stage's own whole-model form, ``top_level(ctx, args, index)`` with ``index`` its position in the
    recipe's ``stages``: at the top level of a recipe the runner calls it once instead of running the stage layer by
    layer on dense statistics (``reconstruct``: a layer-by-layer refit against the reloaded dense model)."""

    @property
    def doc(self) -> str:
        """The stage function's docstring, else its module's."""
        import inspect

        return inspect.getdoc(self.fn) or inspect.getdoc(inspect.getmodule(self.fn)) or ""


STAGES: dict[str, StageDef] = {}


def register_stage(
    name: str,
    args: type[BaseModel],
    scope: Scope,
    needs_calibration: Callable[[BaseModel], bool] = lambda _args: False,
    needs_task: bool = False,
    *,
    paper: str = "",
    budget: Callable[[BaseModel], BudgetMode] | None = None,
    plan: Callable[[Any, BaseModel], int] | None = None,
    touches: Callable[[BaseModel], frozenset[str]] = _no_roles,
    makes_lowrank: Callable[[BaseModel], frozenset[str]] = _no_roles,
    once: str | None = None,
    trains: bool = False,
    layer_grams: Callable[[BaseModel], frozenset[str]] = _no_roles,
    dense_targets: Callable[[BaseModel], frozenset[str]] = _no_roles,
    top_level: Callable[[Any, BaseModel, int], None] | None = None,
):
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in STAGES:
            raise ValueError(f"stage '{name}' registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        STAGES[name] = StageDef(
            name,
            args,
            scope,
            fn,
            summary,
            needs_calibration,
            needs_task,
            paper=paper,
            budget=budget or (lambda _args: "none"),
            plan=plan,
            touches=touches,
            makes_lowrank=makes_lowrank,
            once=once,
            trains=trains,
            layer_grams=layer_grams,
            dense_targets=dense_targets,
            top_level=top_level,
        )
        return fn

    return decorate


def stage_def(name: str) -> StageDef:
    _load_builtin_stages()
    if name not in STAGES:
        raise KeyError(name)
    return STAGES[name]


def stage_names() -> list[str]:
    _load_builtin_stages()
    return sorted(STAGES)


def _load_builtin_stages() -> None:
    # Importing the module registers its stages; kept lazy so the schema imports cheaply.
    import slimkit.recipes.stages  # noqa: F401
