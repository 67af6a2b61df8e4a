"""Stage registry: the names a recipe's ``stage:`` field may use, each a function, its arguments model
(:class:`~slimkit.engine.stage_args.StageArgs`) and a scope (``layer`` or ``model``).

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # stage_args imports the schema, which imports this module
    from slimkit.engine.stage_args import StageArgs

Scope = Literal["layer", "model"]


@dataclass(frozen=True)
class StageDef:
    name: str
    args: type[StageArgs]
    scope: Scope
    fn: Callable[..., Any]
    paper: str = ""
    """The paper section / equations the stage implements."""
    trains: bool = False
    """The stage takes gradient steps through the model (refused with float16 weights: without loss scaling
    float16 activations and gradients overflow or underflow; bfloat16 and float32 train)."""
    once: str | None = None
    """Why the stage may appear only once in a recipe (None: any number of times)."""
    top_level: Callable[[Any, StageArgs, int], None] | None = None
    """A layer stage's own whole-model form, ``top_level(ctx, args, index)`` with ``index`` its position in the
    recipe's ``stages``: at the top level of a recipe the runner calls it once instead of running the stage layer by
    layer on dense statistics (``reconstruct``: a layer-by-layer refit against the reloaded dense model)."""

    @property
    def summary(self) -> str:
        """The first line of the stage function's docstring."""
        return (self.fn.__doc__ or "").strip().splitlines()[0] if self.fn.__doc__ else ""

    @property
    def doc(self) -> str:
        """The stage function's docstring, else its module's."""
        import inspect

        return inspect.getdoc(self.fn) or inspect.getdoc(inspect.getmodule(self.fn)) or ""


STAGES: dict[str, StageDef] = {}


def register_stage(
    name: str,
    args: type[StageArgs],
    scope: Scope,
    *,
    paper: str = "",
    trains: bool = False,
    once: str | None = None,
    top_level: Callable[[Any, StageArgs, int], None] | None = None,
):
    from slimkit.engine.stage_args import StageArgs

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in STAGES:
            raise ValueError(f"stage '{name}' registered twice")
        if not issubclass(args, StageArgs):
            raise TypeError(f"stage '{name}': its arguments {args.__name__} must subclass StageArgs")
        STAGES[name] = StageDef(name, args, scope, fn, paper=paper, trains=trains, once=once, top_level=top_level)
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
    import slimkit.stages  # noqa: F401
