"""Slicing kept coordinates of a grouped residual stream: SP3's fusing of trained hidden masks (§3.3, F.1).

:func:`slice_stream` removes the coordinates a per-group hidden mask zeroed, optionally folding the masks' fractional
values into the weights.

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE
from slimkit.primitives.projection.norms import is_rms_norm, linear_param, readers, set_param


def _boundary(layer: nn.Module) -> str | None:
    """The hook of the group boundary matrix ``layer`` carries (``input``, ``branch``) or None."""
    adapter = layer._modules.get(BASIS_CHANGE)
    return None if adapter is None else adapter.hook


def stream_groups(model: nn.Module) -> list[range]:
    """The model's layer groups: a new group starts at every layer whose input carries a residual matrix
    (``input`` form) or after every layer whose residual branch does (Eq. 34's ``branch`` form)."""
    view = ModelView(model)
    starts = [0] + [
        i
        for i in range(1, view.num_layers)
        if _boundary(view.layer(i).module) == "input" or _boundary(view.layer(i - 1).module) == "branch"
    ]
    ends = [*starts[1:], view.num_layers]
    return [range(start, end) for start, end in zip(starts, ends, strict=True)]


def _index(keep: torch.Tensor, width: int, where: str) -> torch.Tensor:
    keep = torch.as_tensor(keep).flatten().long()
    if keep.numel() == 0:
        raise SlimkitError(f"{where}: at least one coordinate must be kept")
    if keep.min() < 0 or keep.max() >= width or keep.unique().numel() != keep.numel():
        raise SlimkitError(f"{where}: kept coordinates must be distinct indices in [0, {width})")
    return keep.sort().values


def _columns(module: nn.Module, keep: torch.Tensor) -> None:
    owner, name = linear_param(module, "weight", 1)
    set_param(owner, name, getattr(owner, name).detach()[:, keep])


def _rows(module: nn.Module, keep: torch.Tensor, scale: torch.Tensor | None) -> None:
    owner, name = linear_param(module, "weight", 0)
    weight = getattr(owner, name).detach()[keep]
    set_param(owner, name, weight if scale is None else weight.double() * scale.to(weight.device)[:, None])
    bias_owner, bias_name = linear_param(module, "bias", 0)
    bias = getattr(bias_owner, bias_name)
    if bias is not None:
        bias = bias.detach()[keep]
        set_param(bias_owner, bias_name, bias if scale is None else bias.double() * scale.to(bias.device))


def _norm(norm: nn.Module, keep: torch.Tensor) -> None:
    """Slice an RMSNorm in place (its hooks and any attached map stay)."""
    if not is_rms_norm(norm):
        raise SlimkitError(f"slicing the stream needs RMSNorm layers, got a {type(norm).__name__}")
    width = norm.weight.shape[0]
    set_param(norm, "weight", norm.weight.detach()[keep] * math.sqrt(width / keep.numel()))
    if isinstance(norm, nn.RMSNorm):
        norm.normalized_shape = (keep.numel(),)


def slice_stream(model: nn.Module, keep: Sequence[torch.Tensor], scale: Sequence[torch.Tensor] | None = None) -> dict:
    """Keep coordinates ``keep[g]`` of each layer group's stream (:func:`stream_groups`); in place.

    ``scale[g]`` (optional, one value per *original* coordinate of group ``g``) multiplies what
    writes the group's stream, as a fractional mask does (see the module docstring). Returns the
    groups and their new widths.
    """
    view = ModelView(model)
    groups = stream_groups(model)
    if len(keep) != len(groups):
        raise SlimkitError(f"the model has {len(groups)} layer groups, got kept coordinates for {len(keep)}")
    if scale is not None and len(scale) != len(groups):
        raise SlimkitError(f"the model has {len(groups)} layer groups, got scales for {len(scale)}")
    if view.spec.norm_placement == "post":
        raise SlimkitError("slice_stream needs a pre-norm model; BERT has post-norms")
    embedding_map = view.embed_tokens._modules.get(BASIS_CHANGE)
    if embedding_map is not None and (view.spec.extra_embeddings or not view.tied):
        raise SlimkitError("slice_stream: an embedding map is supported on a tied model without position tables")
    widths = [view.layer(group[0]).attn_norm.module.weight.shape[0] for group in groups]
    kept = [_index(k, w, f"group {g}") for g, (k, w) in enumerate(zip(keep, widths, strict=True))]
    scales: list[torch.Tensor | None] = [None] * len(groups)
    if scale is not None:
        scales = [torch.as_tensor(s).double()[k] for s, k in zip(scale, kept, strict=True)]
    tied = view.tied
    head_map = view.final_norm.module._modules.get(BASIS_CHANGE) if view.final_norm is not None else None
    if tied and head_map is None and len(groups) > 1:
        raise SlimkitError("a tied head without a map after the final norm reads the first group's coordinates")
    # the embedding's kept coordinates: group 1's, or with its own basis its top ones, as many as group 1 keeps
    embedding_kept = kept[0] if embedding_map is None else torch.arange(min(kept[0].numel(), embedding_map.in_features))
    with torch.no_grad():
        for module in [view.embed_tokens] + [view.base.get_submodule(p) for p in view.spec.extra_embeddings]:
            weight = module.weight.detach()[:, embedding_kept]
            if scales[0] is not None and embedding_map is None:
                weight = weight.double() * scales[0].to(weight.device)[None, :]
            set_param(module, "weight", weight)
        if embedding_map is not None:
            weight = embedding_map.weight.detach()[kept[0]][:, embedding_kept]
            if scales[0] is not None:
                weight = (weight.double() * scales[0].to(weight.device)[:, None]).to(embedding_map.weight.dtype)
            embedding_map.weight = nn.Parameter(weight.contiguous(), requires_grad=embedding_map.weight.requires_grad)
        if tied:
            view.head.weight = view.embed_tokens.weight
            view.head.in_features = view.embed_tokens.weight.shape[1]
        for g, group in enumerate(groups):
            for index in group:
                layer = view.layer(index)
                for which in ("attn", "mlp"):
                    for module in readers(layer, which):
                        _columns(module, kept[g])
                _rows(layer.linear("o"), kept[g], scales[g])
                writes = g + 1 if _boundary(layer.module) == "branch" else g  # Eq. 34: the next group's
                _rows(layer.linear("down"), kept[writes], scales[writes])
                for norm in (layer.attn_norm, layer.mlp_norm):
                    _norm(norm.module, kept[g])
            if g > 0:
                host = group[0] if _boundary(view.layer(group[0]).module) == "input" else group[0] - 1
                adapter = view.layer(host).module._modules[BASIS_CHANGE]
                weight = adapter.weight.detach()[kept[g]][:, kept[g - 1]]
                if scales[g] is not None:
                    weight = (weight.double() * scales[g].to(weight.device)[:, None]).to(adapter.weight.dtype)
                adapter.weight = nn.Parameter(weight.contiguous(), requires_grad=adapter.weight.requires_grad)
        if view.final_norm is not None:
            _norm(view.final_norm.module, kept[-1])
            if head_map is not None:
                weight = head_map.weight.detach()[embedding_kept][:, kept[-1]]
                head_map.weight = nn.Parameter(weight.contiguous(), requires_grad=head_map.weight.requires_grad)
        if not tied and view.head is not None:
            _columns(view.head, kept[-1])
    return {
        "groups": [[group[0], group[-1]] for group in groups],
        "hidden_sizes": [int(k.numel()) for k in kept],
        "layer_hidden_sizes": [int(kept[g].numel()) for g, group in enumerate(groups) for _ in group],
    }


__all__ = ["slice_stream", "stream_groups"]
