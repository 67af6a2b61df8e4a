"""Stage registry: the names a recipe's ``stage:`` field may use.

A stage is a function plus a pydantic model of its arguments (``extra="forbid"``, so a misspelt
argument fails with the allowed names) and a scope:

* ``layer``: ``fn(ctx, args, layer, stats)`` runs once per layer. At the top level of a recipe its
  statistics come from the dense model; inside ``sequential`` they come from the inputs produced by
  the already-compressed previous layers.
* ``model``: ``fn(ctx, args)`` runs once on the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

Scope = Literal["layer", "model"]


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


STAGES: dict[str, StageDef] = {}


def register_stage(
    name: str,
    args: type[BaseModel],
    scope: Scope,
    needs_calibration: Callable[[BaseModel], bool] = lambda _args: False,
    needs_task: bool = False,
):
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in STAGES:
            raise ValueError(f"stage '{name}' registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        STAGES[name] = StageDef(name, args, scope, fn, summary, needs_calibration, needs_task)
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
