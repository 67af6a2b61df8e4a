"""Registering a stage class under a name (:func:`register_stage`), and the engine's typed view of a registered stage.

The catalogue itself (names, arguments classes, origins, plugins) is :mod:`slimkit.recipes.catalogue`; this module
checks, when a class registers, that it is a :class:`~slimkit.engine.stage.ModelStage` or a
:class:`~slimkit.engine.stage.LayerStage` (mypy checks its method signatures against the protocol and the
arguments class), and derives its scope from which it is.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from slimkit.engine.capabilities import ChecksModel, ChecksReach, PlansMemory, PlansRemoval, ReadsLayerStatistics
from slimkit.engine.stage import AllocatingStage, LayerStage, ModelStage
from slimkit.recipes.catalogue import BUILT_IN, Scope, StageDef, add_stage
from slimkit.recipes.stage_args import ChangesProjections, ChecksRecipe, ReadsData, SharesTarget, StageArgs

CAPABILITIES: tuple[type, ...] = (
    SharesTarget,
    ChangesProjections,
    ReadsData,
    ChecksRecipe,
    PlansRemoval,
    PlansMemory,
    ReadsLayerStatistics,
    ChecksModel,
    ChecksReach,
)
"""Every capability an arguments class may offer (:mod:`slimkit.recipes.stage_args`,
:mod:`slimkit.engine.capabilities`)."""


def undeclared_capabilities(args: type) -> list[str]:
    """``NAME (Capability)`` for each capability method ``args`` defines without inheriting its capability: the engine
    would never ask it, so registration refuses it."""
    found = []
    for capability in CAPABILITIES:
        if issubclass(args, capability):
            continue
        names = [n for n in vars(capability) if not n.startswith("_")]
        found += [f"{n} ({capability.__name__})" for n in names if any(n in vars(k) for k in args.__mro__)]
    return found


ArgsT = TypeVar("ArgsT", bound=StageArgs)
StageClass = TypeVar("StageClass", bound=type)


def register_stage(
    name: str,
    args: type[ArgsT],
    *,
    paper: str = "",
    trains: bool = False,
    once: str | None = None,
) -> Callable[[type[ModelStage[ArgsT]] | type[LayerStage[ArgsT, Any]]], Any]:
    """Register the decorated stage class as ``name`` with arguments ``args`` (its docstring's first line is the
    catalogue's summary). A class with ``run_layer`` is a layer stage; otherwise it must have ``run_model``."""

    def decorate(kind: type[ModelStage[ArgsT]] | type[LayerStage[ArgsT, Any]]) -> Any:
        if not (isinstance(args, type) and issubclass(args, StageArgs)):
            raise TypeError(f"stage '{name}': its arguments {args!r} must subclass StageArgs")
        missing = undeclared_capabilities(args)
        if missing:
            raise TypeError(
                f"stage '{name}': {args.__name__} defines {', '.join(missing)} without inheriting the capability, so "
                "the engine would never ask it; add the capability to its bases"
            )
        stage = kind()
        scope: Scope
        if isinstance(stage, LayerStage):
            scope = "layer"
        elif isinstance(stage, ModelStage):
            scope = "model"
        else:
            raise TypeError(f"stage '{name}': {kind.__name__} has neither run_model nor start/run_layer/finish")
        module = kind.__module__
        origin = BUILT_IN if module.startswith("slimkit.stages") else f"module {module}"
        add_stage(StageDef(name, args, scope, stage, paper=paper, trains=trains, once=once, origin=origin))
        return kind

    return decorate


def model_form(definition: StageDef) -> ModelStage[Any] | None:
    """The stage's whole-model form (a model stage, or a layer stage that also runs at the top level)."""
    stage = definition.stage
    return stage if isinstance(stage, ModelStage) else None


def layer_form(definition: StageDef) -> LayerStage[Any, Any]:
    """The stage's layer-by-layer form (its scope is ``layer``)."""
    stage = definition.stage
    if not isinstance(stage, LayerStage):
        raise TypeError(f"stage '{definition.name}' has no layer form")
    return stage


def allocating_form(definition: StageDef) -> AllocatingStage[Any] | None:
    """The stage's allocation pre-pass, where it has one."""
    stage = definition.stage
    return stage if isinstance(stage, AllocatingStage) else None


__all__ = ["CAPABILITIES", "allocating_form", "layer_form", "model_form", "register_stage", "undeclared_capabilities"]
