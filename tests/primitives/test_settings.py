"""primitives/settings.py: the one base of every pydantic model in the package."""

from __future__ import annotations

import pytest
from pydantic import ConfigDict, ValidationError

from slimkit.primitives.settings import Strict


class Window(Strict):
    size: int = 8
    """Tokens per window."""
    scale: float = 1.0


class Kept(Strict):
    model_config = ConfigDict(extra="allow", allow_inf_nan=True)

    value: float = 0.0


def test_unknown_fields_name_the_closest_and_every_allowed_one() -> None:
    with pytest.raises(ValidationError, match="unknown field 'sise'; did you mean 'size'\\? allowed: size, scale"):
        Window.model_validate({"sise": 4})


def test_non_finite_floats_are_refused_and_docstrings_describe_fields() -> None:
    with pytest.raises(ValidationError):
        Window(scale=float("nan"))
    assert Window.model_fields["size"].description == "Tokens per window."


def test_a_model_that_keeps_unknown_keys_skips_the_check() -> None:
    kept = Kept.model_validate({"value": float("inf"), "extra": 1})
    assert kept.value == float("inf") and kept.model_extra == {"extra": 1}
