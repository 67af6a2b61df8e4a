"""The stage protocol: what a stage is to the engine.

A stage is an object with typed methods, registered under a name with its arguments class
(:func:`slimkit.engine.registry.register_stage`): a :class:`ModelStage` runs once on the whole model, a
:class:`LayerStage` starts its own state, runs on each decoder layer and finishes with a :class:`StageResult`; an
:class:`AllocatingStage` also takes part in its block's allocation pre-pass. The engine keeps one state and one result
per recipe item. What a stage offers before it runs are capabilities of its arguments class.

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.recipes.stage_args import StageArgs

ArtifactWriter = Callable[[Path], object]
"""Writes one extra output of a run into the folder it is given (``OUT/<name>/``)."""


@dataclass(frozen=True)
class StageResult:
    """What a stage leaves: its report entry, manifest entries saved with the model, and extra outputs."""

    details: Mapping[str, Any]
    """The stage's report entry, under its own names (``report.json``'s ``stages.<name>``)."""
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """Entries added to the saved model's manifest (each key once per run)."""
    artifacts: Mapping[str, ArtifactWriter] = field(default_factory=dict)
    """Extra outputs for the run folder: name -> writer of ``OUT/<name>/``."""


class PrePass(Protocol):
    """One allocating stage's part of a block's allocation pre-pass (:mod:`slimkit.engine.allocation_prepass`): what
    it reads of the shared dense pass, what it does with each layer's statistics, and its decision once every layer
    was seen, written into its stage's own state."""

    scoring_batches: int | None
    """How many of the calibration batches (the first ones) it scores on; None: the weights alone (no forward)."""
    roles: frozenset[LinearRole]
    """The projections whose input Grams it reads."""
    last: int
    """The last layer it reads."""

    def visit(self, layer: LayerView, stats: LayerStats) -> None: ...

    def decide(self, ctx: Context, pass_seconds: float) -> None:
        """Decide the allocation (``pass_seconds``: what the block's shared dense pass took) and, for a fixed-budget
        stage, make the block's plan exact (``ctx.block.planned``)."""
        ...


ArgsT = TypeVar("ArgsT", bound=StageArgs, contravariant=True)
StateT = TypeVar("StateT")
StateIn = TypeVar("StateIn", contravariant=True)


@runtime_checkable
class ModelStage(Protocol[ArgsT]):
    """A stage that runs once on the whole model."""

    def run_model(self, ctx: Context, args: ArgsT) -> StageResult: ...


@runtime_checkable
class LayerStage(Protocol[ArgsT, StateT]):
    """A stage that runs one decoder layer at a time, keeping its own state across the layers of its block."""

    def start(self, ctx: Context, args: ArgsT) -> StateT:
        """The stage's state for one block, before its first layer (after the block's budget started)."""
        ...

    def run_layer(self, state: StateT, layer: LayerView, stats: LayerStats) -> None:
        """Act on one layer, with the statistics the block's pass gathered for it."""
        ...

    def finish(self, state: StateT) -> StageResult:
        """What the stage leaves once every layer ran."""
        ...


@runtime_checkable
class AllocatingStage(Protocol[StateIn]):
    """A layer stage that decides each layer's share of its budget before its block runs."""

    def allocation_prepass(self, state: StateIn) -> PrePass | None:
        """Its part of the block's pre-pass (None: this configuration allocates nothing); it writes its decision
        into ``state``."""
        ...


__all__ = ["AllocatingStage", "ArtifactWriter", "LayerStage", "ModelStage", "PrePass", "StageResult"]
