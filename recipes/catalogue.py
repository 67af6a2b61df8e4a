"""The stage catalogue: the names a recipe's ``stage:`` field may use, each with its arguments class, scope and origin.

Built-in stages register when the ``slimkit.stages`` package is imported (the one lazy import below); stages of other
installed packages are found through the ``slimkit.stages`` entry-point group (``[project.entry-points."slimkit.stages"]
NAME = "package.module:Class"``, the entry point named as the stage): importing the entry point registers it. A
plugin that fails to import stays in the catalogue as :class:`BrokenStage`, refused in one line where a recipe names
it. The stage objects themselves are typed by the engine (:mod:`slimkit.engine.stage`,
:mod:`slimkit.engine.registry`); here they are opaque.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.stage_args import StageArgs

Scope = Literal["layer", "model"]
ENTRY_POINT_GROUP = "slimkit.stages"
BUILT_IN = "slimkit (built in)"


@dataclass(frozen=True)
class StageDef:
    """One registered stage: its name, arguments class, scope, the stage object and where it comes from."""

    name: str
    args: type[StageArgs]
    scope: Scope
    stage: object
    """The stage object (:class:`~slimkit.engine.stage.ModelStage` or :class:`~slimkit.engine.stage.LayerStage`)."""
    paper: str = ""
    """The paper section / equations the stage implements."""
    trains: bool = False
    """The stage takes gradient steps through the model (refused with float16 weights: without loss scaling
    float16 activations and gradients overflow or underflow; bfloat16 and float32 train)."""
    once: str | None = None
    """Why the stage may appear only once in a recipe (None: any number of times)."""
    origin: str = BUILT_IN
    """Where the stage comes from: slimkit itself, an installed package's entry point, or a module that registered it
    at run time."""

    @property
    def summary(self) -> str:
        """The first line of the stage class's docstring."""
        doc = self.doc
        return doc.splitlines()[0] if doc else ""

    @property
    def doc(self) -> str:
        """The stage class's docstring, else its module's."""
        kind = type(self.stage)
        return inspect.getdoc(kind) or inspect.getdoc(inspect.getmodule(kind)) or ""


@dataclass(frozen=True)
class BrokenStage:
    """A plugin stage whose entry point could not be loaded: why, in one line."""

    name: str
    origin: str
    error: str

    def refusal(self) -> str:
        return f"stage '{self.name}' ({self.origin}) cannot be used: {self.error}"


STAGES: dict[str, StageDef] = {}
BROKEN: dict[str, BrokenStage] = {}
_loaded = False


def add_stage(definition: StageDef) -> None:
    """Add a stage to the catalogue (the engine's ``register_stage`` calls this); a name is registered once."""
    known = STAGES.get(definition.name)
    if known is not None:
        if known.stage is definition.stage or type(known.stage) is type(definition.stage):
            return  # the same class registered again (its module imported twice)
        raise ValueError(f"stage '{definition.name}' registered twice ({known.origin} and {definition.origin})")
    STAGES[definition.name] = definition


def stage_def(name: str) -> StageDef:
    """The stage registered as ``name``; ``KeyError`` when none is, :class:`SlimkitError` for a broken plugin."""
    load_stages()
    if name in BROKEN and name not in STAGES:
        raise SlimkitError(BROKEN[name].refusal())
    if name not in STAGES:
        raise KeyError(name)
    return STAGES[name]


def stage_names() -> list[str]:
    """Every usable stage name, sorted (broken plugins left out: :data:`BROKEN`)."""
    load_stages()
    return sorted(STAGES)


def load_stages() -> None:
    """The built-in stages, then every installed plugin's, once per process."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import slimkit.stages  # noqa: F401  (importing the package registers the built-in stages)

    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _load_plugin(entry)


def _load_plugin(entry: metadata.EntryPoint) -> None:
    """Import one plugin entry point; the stages it registers are marked with their package."""
    dist = entry.dist
    origin = f"package {dist.name} {dist.version}" if dist is not None else "an installed package"
    origin += f", entry point {entry.name} = {entry.value}"
    before = set(STAGES)
    try:
        entry.load()
    except Exception as error:  # a plugin's import error must not break the other stages
        message = str(error).splitlines()[0] if str(error) else ""
        BROKEN[entry.name] = BrokenStage(entry.name, origin, f"its import failed: {type(error).__name__}: {message}")
        return
    for name in set(STAGES) - before:
        STAGES[name] = dataclasses.replace(STAGES[name], origin=origin)
    if entry.name not in STAGES:
        BROKEN[entry.name] = BrokenStage(
            entry.name,
            origin,
            f"importing it registered no stage named '{entry.name}' (decorate the stage class with "
            "slimkit.engine.registry.register_stage and name the entry point after the stage)",
        )


__all__ = [
    "BROKEN",
    "BUILT_IN",
    "ENTRY_POINT_GROUP",
    "STAGES",
    "BrokenStage",
    "Scope",
    "StageDef",
    "add_stage",
    "load_stages",
    "stage_def",
    "stage_names",
]
