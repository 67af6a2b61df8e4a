"""Fused projections seen as their parts: Phi-3's ``qkv_proj`` as q/k/v and its ``gate_up_proj`` as gate/up.

:class:`FusedLinear` holds one Linear per part (named as in Llama: ``q_proj``, ``gate_proj``, ...) and concatenates
their outputs in the fused order, so the model's own forward reads exactly what the fused matrix gave while groups,
scorers, low-rank and projections see ordinary projections. :func:`split_fused` installs the views (at load),
:func:`fused_for_save` writes them back as the stock fused tensors of a plain folder, :func:`fuse_tensors` does the
same on a dense tensor dict (exports). Which matrices are fused, and how wide each part is, is data
(``ArchSpec.fused``).

Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec, FusedProjection
from slimkit.primitives.errors import SlimkitError


class FusedLinear(nn.Module):
    """One fused projection as named parts: ``forward(x) = cat([part(x) for part in parts], -1)``."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        if not parts:
            raise ValueError("a fused projection needs at least one part")
        for name, module in parts.items():
            self.add_module(name, module)

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(self._modules)

    @property
    def in_features(self) -> int:
        return int(next(iter(self.children())).in_features)

    @property
    def out_features(self) -> int:
        return sum(int(part.out_features) for part in self.children())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.children()], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (parts concatenated in order)"


def fused_spec(model: nn.Module) -> ArchSpec | None:
    """The model's spec when its architecture has fused projections, else None."""
    spec = ARCH_SPECS.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return spec if spec is not None and spec.fused else None


def _layers(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    return model.base_model.get_submodule(spec.layers)


def _part_widths(fused: FusedProjection, config: Any, head_dim: int) -> list[int]:
    widths = [int(getattr(config, key)) for key in fused.part_widths]
    return [w * head_dim for w in widths] if fused.per_head else widths


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _split_linear(linear: nn.Linear, fused: FusedProjection, widths: list[int]) -> FusedLinear:
    if sum(widths) != linear.out_features:
        raise SlimkitError(
            f"{fused.path}: {linear.out_features} output rows, but the config gives parts {', '.join(fused.parts)} "
            f"of {', '.join(map(str, widths))} rows"
        )
    parts: dict[str, nn.Module] = {}
    start = 0
    for name, width in zip(fused.parts, widths, strict=True):
        weight = linear.weight
        part = nn.Linear(linear.in_features, width, bias=linear.bias is not None, device="meta", dtype=weight.dtype)
        part.weight = nn.Parameter(weight.detach()[start : start + width].clone(), requires_grad=weight.requires_grad)
        if linear.bias is not None:
            part.bias = nn.Parameter(linear.bias.detach()[start : start + width].clone())
        parts[name] = part
        start += width
    return FusedLinear(parts)


def _fused_modules(model: nn.Module) -> Iterator[tuple[int, nn.Module, FusedProjection, nn.Module]]:
    """``(layer index, layer, fused projection, its module now)`` for every fused projection ``model`` still has
    (one whose block was removed is skipped); each path is resolved when reached, so callers may replace modules."""
    spec = fused_spec(model)
    if spec is None:
        return
    for index, layer in enumerate(_layers(model, spec)):
        for fused in spec.fused:
            try:
                module = layer.get_submodule(fused.path)
            except AttributeError:
                continue  # its block was removed
            yield index, layer, fused, module


def is_split(model: nn.Module) -> bool:
    """Whether every fused projection of ``model`` is a :class:`FusedLinear` view (True without fused ones)."""
    return all(isinstance(module, FusedLinear) for _, _, _, module in _fused_modules(model))


def split_fused(model: nn.Module) -> nn.Module:
    """Replace each fused projection of ``model`` by a :class:`FusedLinear` of its parts, in place (exact: the
    parts are row slices of the fused matrix). Part widths come from the model's config. Idempotent; a model
    without fused projections is returned unchanged."""
    if fused_spec(model) is None:
        return model
    config = model.config
    head_dim = _head_dim(config)
    for _, layer, fused, module in _fused_modules(model):
        if isinstance(module, FusedLinear):
            continue
        if not isinstance(module, nn.Linear):
            raise SlimkitError(f"{fused.path} is a {type(module).__name__}, not the fused Linear slimkit splits")
        layer.set_submodule(fused.path, _split_linear(module, fused, _part_widths(fused, config, head_dim)))
    return model


def _plain_parts(view: FusedLinear, where: str) -> list[nn.Linear]:
    parts = list(view.children())
    if not all(type(part) is nn.Linear for part in parts):
        kinds = ", ".join(type(part).__name__ for part in parts)
        raise SlimkitError(f"{where}: the parts ({kinds}) are not all plain Linear layers, so they cannot be fused")
    return parts  # type: ignore[return-value]


@contextmanager
def fused_for_save(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, each :class:`FusedLinear` of ``model`` is the stock fused ``nn.Linear`` (for
    ``save_pretrained`` of a plain folder); afterwards the views are back, the same modules and parameters.

    The fused weight is built once per projection and the parts' weights become row views of it, so this needs
    no second copy of the weights."""
    swapped: list[tuple[nn.Module, str, FusedLinear]] = []
    try:
        for index, layer, fused, view in _fused_modules(model):
            if not isinstance(view, FusedLinear):
                continue
            plain = _fuse_parts(_plain_parts(view, f"layer {index} {fused.path}"))
            swapped.append((layer, fused.path, view))
            layer.set_submodule(fused.path, plain)
        yield model
    finally:
        for layer, path, view in swapped:
            layer.set_submodule(path, view)


def _fuse_parts(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear over ``parts`` stacked by rows; each part's weight (and bias) becomes a view of it."""
    first = parts[0].weight
    has_bias = all(part.bias is not None for part in parts)
    fused = nn.Linear(first.shape[1], sum(p.out_features for p in parts), bias=has_bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=first.requires_grad)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]))
    start = 0
    for part in parts:
        rows = part.out_features
        part.weight.data = fused.weight.data[start : start + rows]
        if has_bias:
            part.bias.data = fused.bias.data[start : start + rows]
        start += rows
    return fused


def fuse_tensors(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``tensors`` (a model's dense, Hugging Face-named weights) with each split projection's parts concatenated
    back under the fused name (``...qkv_proj.q_proj.weight`` ... into ``...qkv_proj.weight``), in place."""
    if fused_spec(model) is None:
        return tensors
    paths = {id(module): name for name, module in model.named_modules()}
    for _, _, _, view in _fused_modules(model):
        if not isinstance(view, FusedLinear):
            continue
        prefix = paths[id(view)]
        for leaf in ("weight", "bias"):
            keys = [f"{prefix}.{part}.{leaf}" for part in view.part_names]
            if all(key in tensors for key in keys):
                tensors[f"{prefix}.{leaf}"] = torch.cat([tensors.pop(key) for key in keys])
    return tensors


__all__ = ["FusedLinear", "fuse_tensors", "fused_for_save", "fused_spec", "is_split", "split_fused"]
