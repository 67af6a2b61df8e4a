"""Running a recipe's stages: each top-level item in one of two forms, and what every stage leaves.

* **whole model**: a top-level item whose stage has a whole-model form (:class:`~slimkit.engine.stage.ModelStage`:
  a model-scope stage, or a layer stage that also runs at the top level, ``reconstruct``'s refit against the
  reloaded dense model) runs it once;
* **layer by layer**: a ``sequential`` block (each layer's inputs from the compressed layers before it) or a layer
  stage on its own (inputs from the dense layers): every stage of the block starts its state, the block's allocation
  pre-pass runs (:func:`slimkit.engine.allocation_prepass.allocate_block`), the layers run one at a time
  (:func:`slimkit.engine.layerwise.run_layerwise`), then every stage finishes.

Before each item the one budget's block starts (:meth:`Context.start_block`) with what its fixed-budget stages
plan to remove; after it, the item's share of the target's part is recorded. Each stage's
:class:`~slimkit.engine.stage.StageResult` is kept, in recipe order, for the run's last phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slimkit.engine.allocation_prepass import allocate_block
from slimkit.engine.capabilities import PlansRemoval
from slimkit.engine.context import Context
from slimkit.engine.layerwise import BlockMember, run_layerwise
from slimkit.engine.progress import Timings
from slimkit.engine.registry import layer_form, model_form
from slimkit.engine.stage import StageResult
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.recipes.catalogue import StageDef, stage_def
from slimkit.recipes.schema import SequentialSpec, StageItem, StageSpec
from slimkit.recipes.stage_args import SharesTarget, offered


@dataclass(frozen=True)
class StageRun:
    """One stage of the recipe as it ran: its definition and what it left."""

    definition: StageDef
    result: StageResult


@dataclass
class StagesOutcome:
    """Every top-level item's share of the target's part (by item label) and every stage's result, in order."""

    shares: dict[str, float] = field(default_factory=dict)
    runs: list[StageRun] = field(default_factory=list)


def block_children(item: StageItem) -> tuple[list[StageSpec], str]:
    """The stages of a top-level item and how their layer inputs propagate (``compressed`` inside ``sequential``)."""
    if isinstance(item, SequentialSpec):
        return item.sequential, "compressed"
    return [item], "dense"


def item_label(index: int, item: StageItem) -> str:
    """``0:prune``, ``1:sequential[lowrank,reconstruct]``: the item's key in the timings and the target's shares."""
    if isinstance(item, SequentialSpec):
        return f"{index}:sequential[{','.join(s.stage for s in item.sequential)}]"
    return f"{index}:{item.stage}"


def block_plan(ctx: Context, children: list[StageSpec]) -> int:
    """Parameters the block's fixed-budget stages plan to remove (a solve stage in it subtracts them)."""
    planned = 0
    for spec in children:
        args = spec.parsed_args()
        if offered(args, SharesTarget).budget() in ("explicit", "layer"):
            planned += offered(args, PlansRemoval).plan(ctx)
    return planned


def start_item(ctx: Context, index: int, item: StageItem) -> None:
    """Start the item's block of the one budget: the parameters now, and what its fixed-budget stages plan."""
    ctx.start_block(index, item_label(index, item))
    ctx.block.planned = block_plan(ctx, block_children(item)[0])


def run_item(ctx: Context, item: StageItem) -> list[StageRun]:
    """Run one top-level item (its block started) in its form; returns its stages' results."""
    children, propagate = block_children(item)
    if not isinstance(item, SequentialSpec):
        definition = stage_def(item.stage)
        whole = model_form(definition)
        if whole is not None:
            return [StageRun(definition, whole.run_model(ctx, item.parsed_args()))]
    return run_block(ctx, children, propagate == "compressed")


def run_block(ctx: Context, children: list[StageSpec], compressed: bool) -> list[StageRun]:
    """Layer-scope stages layer by layer: each starts its state, the block's pre-pass allocates, the layers run, each
    finishes."""
    members = []
    for spec in children:
        definition = stage_def(spec.stage)
        args = spec.parsed_args()
        stage = layer_form(definition)
        members.append(BlockMember(definition, args, stage, stage.start(ctx, args)))
    allocate_block(ctx, members)  # each layer's share, for stages that allocate (engine/allocation_prepass.py)
    with ctx.tracker.task(ctx.block.label, ctx.view.num_layers) as advance:
        run_layerwise(ctx, members, "compressed" if compressed else "dense", on_layer=lambda _i: advance(1))
    return [StageRun(m.definition, m.stage.finish(m.state)) for m in members]


def run_stages(ctx: Context, timings: Timings) -> StagesOutcome:
    """Run every top-level item; returns each one's share (the fraction of the dense target part it removed) and
    every stage's result."""
    part = ctx.recipe.target.part
    outcome = StagesOutcome()
    for index, item in enumerate(ctx.recipe.stages):
        before = params_by_part(ctx.model)[part]
        start_item(ctx, index, item)
        with timings.stage(ctx.block.label):
            outcome.runs += run_item(ctx, item)
        outcome.shares[ctx.block.label] = (before - params_by_part(ctx.model)[part]) / ctx.params_before[part]
    return outcome


__all__ = [
    "StageRun",
    "StagesOutcome",
    "block_children",
    "block_plan",
    "item_label",
    "run_block",
    "run_item",
    "run_stages",
    "start_item",
]
