"""The one base of every pydantic model in the package: :class:`Strict`.

A settings block (a recipe, a stage's arguments, mask, refit or allocation settings) refuses unknown fields with the
list of allowed ones (:func:`slimkit.primitives.errors.unknown`) and non-finite floats, and takes each field's
docstring as its description (``slimkit stage show`` prints them). A model that keeps or ignores unknown keys (the
run report's parts) derives from it too and overrides ``extra`` and ``allow_inf_nan`` in its own ``model_config``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from slimkit.primitives.errors import unknown


class Strict(BaseModel):
    """Base of every pydantic model: unknown fields fail with the list of allowed ones, and no float field accepts
    inf or NaN (``allow_inf_nan=False``); a subclass that sets ``extra`` to allow or ignore skips the field check."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            unknown_keys = [key for key in data if key not in cls.model_fields]
            if unknown_keys:
                raise ValueError(unknown("field", unknown_keys[0], cls.model_fields))
        return data


__all__ = ["Strict"]
