"""What the grid counts on a loaded model: where it is, its residual and low-rank parameters, its layers' parameters
and widths.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any


def placement_of(model: Any) -> dict[str, Any]:
    """Where ``model`` is and in which dtype, as a run report's ``placement`` states it (``device``, ``dtype`` and,
    on CUDA, ``gpu``, ``gpu_memory_gib``, ``cuda``)."""
    from slimkit.primitives.device.placement import Placement

    parameter = next(model.parameters())
    return Placement(parameter.device, parameter.dtype).describe()


RESIDUAL_NAMES = ("residual", "basis_change", "basischange")


def residual_params_in_model(model: Any) -> int:
    """Parameters of modules or tensors named or typed as residual / basis-change matrices (SP3's
    ``BasisChange`` at ``<host>.basis_change``, or ``residual`` in a parameter's path or class name)."""
    total = 0
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        typed = any(n in type(module).__name__.lower() for n in RESIDUAL_NAMES)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            if typed or any(n in f"{module_name}.{name}".lower() for n in RESIDUAL_NAMES):
                seen.add(id(param))
                total += param.numel()
    return total


def lowrank_params(model: Any) -> int:
    from slimkit.primitives.lowrank import LowRankLinear

    return sum(p.numel() for m in model.modules() if isinstance(m, LowRankLinear) for p in m.parameters())


def layer_params(model: Any) -> list[int]:
    from slimkit.primitives.arch import ModelView

    return [layer.num_params() for layer in ModelView(model).layers]


def layer_widths(model: Any, saved: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per-layer widths: the saved ones (manifest ``layer_widths``) or the model's, each with the hidden
    width the layer works in (its q projection's input width; SP3 changes it per group)."""
    from slimkit.primitives.arch import ModelView

    view = ModelView(model)
    widths = [dict(w) for w in (saved or view.layer_widths())]
    try:
        hidden = [int(layer.linear("q").in_features) for layer in view.layers]
    except (AttributeError, KeyError, ValueError):
        return widths
    if len(hidden) == len(widths):
        for width, size in zip(widths, hidden, strict=True):
            width.setdefault("hidden_size", size)
    return widths


def finite_numbers(node: Any) -> bool:
    return all(math.isfinite(v) for v in _numbers(node))


def _numbers(node: Any) -> Iterator[float]:
    if isinstance(node, bool):
        return
    if isinstance(node, int | float):
        yield float(node)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _numbers(value)
