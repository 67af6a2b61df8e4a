"""What every registered stage declares through ``StageArgs`` agrees with what its methods answer."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from slimkit.engine.registry import stage_def, stage_names
from slimkit.engine.stage_args import StageArgs


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
    declared = definition.args.calibration_depends_on
    assert set(declared) <= set(definition.args.model_fields), declared
    defaults = definition.args()
    for field, variant in _variants(definition.args, defaults):
        if field not in declared:
            assert variant.needs_calibration() == defaults.needs_calibration(), (name, field)


def test_the_defaults_describe_a_stage_that_removes_nothing():
    args = StageArgs()
    assert args.budget() == "none" and not args.needs_calibration() and not args.needs_gradients()
    assert not args.reloads_dense() and args.holdout_batches() == 0 and args.reach_check("any") is None
    assert args.touches() == frozenset() and args.calibration_depends_on == ()
