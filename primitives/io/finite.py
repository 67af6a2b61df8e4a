"""Whether a model's weights are all finite: the one check every reader and writer of weights makes.

:func:`non_finite_tensors` lists every state-dict tensor holding NaN or inf (``save`` refuses to write them);
:func:`check_finite_weights` stops at the first one and names it in one :class:`SlimkitError` line, for the inputs of
``export``, ``eval`` and a run's load phase (a NaN weight would otherwise be exported, printed as a ``nan`` metric or
met as a traceback after calibration). Both go tensor by tensor, in chunks of at most :data:`CHECK_CHUNK` elements:
no model-sized copy, and an offloaded (meta) tensor is read from accelerate's weights map one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from slimkit.primitives.errors import SlimkitError

CHECK_CHUNK = 1 << 24
"""Elements per ``torch.isfinite`` call: bounds the temporary boolean tensor (16 MiB) for big weights."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point ``tensor`` is finite, without copying it."""
    if tensor.dim() == 0 or tensor.numel() <= CHECK_CHUNK:
        return bool(torch.isfinite(tensor).all())
    rows = max(1, CHECK_CHUNK // max(1, tensor[0].numel()))
    return all(bool(torch.isfinite(tensor[start : start + rows]).all()) for start in range(0, len(tensor), rows))


def offloaded_value(model: nn.Module, name: str) -> torch.Tensor:
    """A meta tensor's value from accelerate's weights map, as ``save_pretrained`` reads it."""
    from transformers.integrations.accelerate import load_offloaded_parameter

    try:
        return load_offloaded_parameter(cast(Any, model), name)
    except (ValueError, KeyError, AttributeError):
        raise SlimkitError(
            f"{name} is on the meta device and no offloaded weights hold it; nothing was written"
        ) from None


def finite_checks(model: nn.Module) -> Iterator[tuple[str, bool]]:
    """``(name, finite)`` for each floating-point state-dict tensor of ``model``, in order; tied tensors once."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        seen.add(id(tensor))
        value = offloaded_value(model, name) if tensor.device.type == "meta" else tensor.detach()
        finite = all_finite(value)
        del value
        yield name, finite


def non_finite_tensors(model: nn.Module) -> tuple[list[str], int]:
    """The names of the state-dict tensors of ``model`` holding NaN or inf, and how many tensors were checked.

    Tied tensors are checked once; integer and boolean tensors cannot hold NaN/inf and are not counted.
    """
    bad: list[str] = []
    checked = 0
    for name, finite in finite_checks(model):
        checked += 1
        if not finite:
            bad.append(name)
    return bad, checked


def first_non_finite(model: nn.Module) -> str | None:
    """The name of the first state-dict tensor of ``model`` holding NaN or inf, or None."""
    return next((name for name, finite in finite_checks(model) if not finite), None)


def check_finite_weights(model: nn.Module, what: str) -> None:
    """One :class:`SlimkitError` line naming the first weight of ``what`` (e.g. ``model folder X``) that holds NaN or
    inf; nothing is computed from such weights."""
    name = first_non_finite(model)
    if name is not None:
        raise SlimkitError(
            f"{what}: weight {name} holds NaN or inf; slimkit does not compress, evaluate or export non-finite "
            "weights (the checkpoint is damaged or diverged): use a finite checkpoint"
        )


__all__ = [
    "CHECK_CHUNK",
    "all_finite",
    "check_finite_weights",
    "finite_checks",
    "first_non_finite",
    "non_finite_tensors",
    "offloaded_value",
]
