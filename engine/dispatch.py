"""Running a recipe's stages: each top-level item runs in one of the registered stage forms.

A form says how an item runs and matches items by their shape:

* ``whole_model``: a ``model``-scope stage, ``fn(ctx, args)`` once;
* ``own_top_level``: a layer stage that declares its own whole-model form (``StageDef.top_level``, ``reconstruct``'s
  layer-by-layer refit against the reloaded dense model), called once with the item's position;
* ``layerwise``: a ``sequential`` block (layer by layer, each layer's inputs from the compressed layers before it)
  or a layer stage on its own (inputs from the dense layers), one progress step per layer
  (:func:`slimkit.engine.layerwise.run_layerwise`), after the allocation pre-pass of its stages that allocate
  (:func:`slimkit.engine.allocation_prepass.allocate_block`).

Before each item the one budget's block starts (:meth:`Context.start_block`) with what its fixed-budget stages
plan to remove; after it, the item's share of the target's part is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slimkit.engine.allocation_prepass import allocate_block
from slimkit.engine.context import Context
from slimkit.engine.layerwise import run_layerwise
from slimkit.engine.progress import Timings
from slimkit.engine.registry import StageDef, stage_def
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.recipes.schema import SequentialSpec, StageItem, StageSpec


@dataclass(frozen=True)
class StageForm:
    """One way a top-level recipe item runs: ``matches(item, definition)`` picks it, ``run(ctx, item, index, label)``
    runs it (``definition`` is the item's first stage's)."""

    name: str
    matches: Callable[[StageItem, StageDef], bool]
    run: Callable[[Context, StageItem, int, str], None]


def _whole_model(ctx: Context, item: StageSpec, _index: int, _label: str) -> None:
    stage_def(item.stage).fn(ctx, item.parsed_args())


def _own_top_level(ctx: Context, item: StageSpec, index: int, _label: str) -> None:
    stage_def(item.stage).top_level(ctx, item.parsed_args(), index)


def _layerwise(ctx: Context, item: StageItem, _index: int, label: str) -> None:
    children, propagate = block_children(item)
    allocate_block(ctx, children)  # each layer's share, for stages that allocate (engine/allocation_prepass.py)
    with ctx.tracker.task(label, ctx.view.num_layers) as advance:
        run_layerwise(ctx, children, propagate, on_layer=lambda _i: advance(1))


STAGE_FORMS: list[StageForm] = [
    StageForm(
        "whole_model",
        lambda item, definition: not isinstance(item, SequentialSpec) and definition.scope == "model",
        _whole_model,
    ),
    StageForm(
        "own_top_level",
        lambda item, definition: not isinstance(item, SequentialSpec) and definition.top_level is not None,
        _own_top_level,
    ),
    StageForm("layerwise", lambda _item, _definition: True, _layerwise),
]
"""The forms, tried in order; the last matches every item."""


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


def stage_form(item: StageItem) -> StageForm:
    definition = stage_def(block_children(item)[0][0].stage)
    return next(form for form in STAGE_FORMS if form.matches(item, definition))


def block_plan(ctx: Context, children: list[StageSpec]) -> int:
    """Parameters the block's fixed-budget stages plan to remove (a solve stage in it subtracts them)."""
    planned = 0
    for spec in children:
        args = spec.parsed_args()
        if args.budget() in ("explicit", "layer"):
            planned += args.plan(ctx)
    return planned


def run_stages(ctx: Context, timings: Timings) -> dict[str, float]:
    """Run every top-level item; returns each one's share: the fraction of the dense target part it removed."""
    part = ctx.recipe.target.part
    shares: dict[str, float] = {}
    for index, item in enumerate(ctx.recipe.stages):
        before = params_by_part(ctx.model)[part]
        label = item_label(index, item)
        ctx.start_block()
        ctx.block_planned = block_plan(ctx, block_children(item)[0])
        with timings.stage(label):
            stage_form(item).run(ctx, item, index, label)
        shares[label] = (before - params_by_part(ctx.model)[part]) / ctx.params_before[part]
    return shares
