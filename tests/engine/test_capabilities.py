"""Every registered stage's arguments answer the capability questions consistently, and a stage that offers none
answers them as a stage that removes nothing and reads nothing."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from slimkit.engine.capabilities import (
    ChecksModel,
    PlansMemory,
    PlansRemoval,
    ReadsLayerStatistics,
    default_memory,
    memory_of,
)
from slimkit.engine.registry import CAPABILITIES, undeclared_capabilities
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.device.memory_model import ModelShape
from slimkit.recipes.catalogue import stage_def, stage_names
from slimkit.recipes.stage_args import (
    ChangesProjections,
    ChecksRecipe,
    ReadsData,
    SharesTarget,
    StageArgs,
    offered,
)


def _variants(args_class: type[StageArgs], defaults: StageArgs) -> list[tuple[str, StageArgs]]:
    """Each bool flipped and each other choice of a Literal field, one at a time (where the arguments allow it)."""
    found = []
    for name, field in args_class.model_fields.items():
        annotation = field.annotation
        values: tuple = ()
        if annotation is bool:
            values = (not getattr(defaults, name),)
        elif typing.get_origin(annotation) is typing.Literal:
            values = tuple(v for v in typing.get_args(annotation) if v != getattr(defaults, name))
        for value in values:
            try:
                found.append((name, args_class.model_validate({name: value})))
            except ValidationError:
                continue
    return found


@pytest.mark.parametrize("name", stage_names())
def test_calibration_depends_only_on_the_declared_arguments(name):
    definition = stage_def(name)
    declared = definition.args.calibration_depends_on if issubclass(definition.args, ReadsData) else ()
    assert set(declared) <= set(definition.args.model_fields), declared
    defaults = definition.args()
    for field, variant in _variants(definition.args, defaults):
        if field not in declared:
            needs = offered(variant, ReadsData).needs_calibration()
            assert needs == offered(defaults, ReadsData).needs_calibration(), (name, field)


@pytest.mark.parametrize("name", stage_names())
def test_every_capability_a_stage_answers_is_one_it_declares(name):
    assert undeclared_capabilities(stage_def(name).args) == []


def test_a_stage_without_capabilities_removes_nothing_and_reads_nothing():
    class Nothing(StageArgs):
        pass

    args = Nothing()
    assert offered(args, SharesTarget).budget() == "none"
    assert offered(args, PlansRemoval).plan(None) == 0  # type: ignore[arg-type]  (the default reads nothing)
    projections = offered(args, ChangesProjections)
    assert projections.touches() == projections.makes_lowrank() == projections.refits() == frozenset()
    data = offered(args, ReadsData)
    assert not data.needs_calibration() and not data.needs_task() and not data.reloads_dense()
    assert data.holdout_batches() == 0 and data.calibration_depends_on == ()
    assert offered(args, ChecksRecipe).check_recipe(None, "stages.0") is None  # type: ignore[arg-type]
    statistics = offered(args, ReadsLayerStatistics)
    assert statistics.layer_grams() == statistics.dense_targets() == frozenset()
    assert offered(args, ChecksModel).operations() == frozenset() and not offered(args, ChecksModel).encoder_only
    shape = ModelShape(vocab=10, hidden=4, intermediate=8, layers=1, heads=1, kv_heads=1, head_dim=4)
    inputs = MemoryInputs(shape, None, 4)
    assert memory_of(args, "nothing", inputs).parts == {} == default_memory(args, "nothing", inputs).parts
    assert offered(args, PlansMemory).block_matrix_bytes(shape) == 0
    assert undeclared_capabilities(Nothing) == []
    assert all(not isinstance(args, capability) for capability in CAPABILITIES)
