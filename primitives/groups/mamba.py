"""Coupling groups of a Mamba-2 layer: heads (``mamba_head``) and head channels (``mamba_channel``).

A head owns its ``z``, ``x`` and ``dt`` rows of ``in_proj``, its ``x`` convolution channels, its ``A_log``, ``D`` and
``dt_bias``, its gated-norm weights and ``out_proj`` columns (``B`` and ``C`` are its SSM group's); a head channel is
channel ``p`` of every head. The gated RMSNorm averages over an SSM group's channels, so removal rescales its weight
by ``sqrt(width before / width after)``: removing a unit then equals zeroing its ``x`` up to the norm's epsilon.

Method note: docs/methods/architectures.md (per-layer kinds).
"""

from __future__ import annotations

import torch

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.mixers import Mamba2View
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, Member
from slimkit.primitives.groups.linear_attention import param_members, unit_blocks


def mamba_view(layer: LayerView) -> Mamba2View:
    mixer = layer.mixer
    if not isinstance(mixer, Mamba2View):
        raise SlimkitError(f"layer {layer.index} holds no Mamba-2 mixer")
    return mixer


def _members(view: ModelView, mixer: Mamba2View, channels: torch.Tensor, heads: torch.Tensor | None) -> list[Member]:
    """Members of units owning the head channels ``channels`` (``[units, per_unit]`` positions in ``[0, H*P)``) and,
    for whole heads, the ``heads`` positions (``[units, per_unit]`` in ``[0, H)``)."""
    root = view.path_of(mixer.module)
    width = mixer.intermediate_size
    rows = torch.cat([channels, channels + width], dim=1)  # z rows, then x rows
    if heads is not None:
        dt = 2 * width + 2 * mixer.num_groups * mixer.state_size
        rows = torch.cat([rows, heads + dt], dim=1)
    members = param_members(f"{root}.in_proj", mixer.module.in_proj, 0, rows)
    members += param_members(f"{root}.conv1d", mixer.module.conv1d, 0, channels)
    members.append(Member(f"{root}.norm", "weight", 0, channels))
    if heads is not None:
        members += [Member(root, name, 0, heads) for name in ("A_log", "D", "dt_bias")]
    members += param_members(f"{root}.out_proj", mixer.module.out_proj, 1, channels)
    return members


def mamba_head_group(view: ModelView, layer: LayerView) -> Group:
    """The heads of one Mamba-2 layer (kept in equal numbers in every SSM group)."""
    mixer = mamba_view(layer)
    heads = mixer.num_heads
    members = _members(view, mixer, unit_blocks(heads, mixer.head_dim), unit_blocks(heads, 1))
    norm = f"{view.path_of(mixer.module)}.norm"
    return Group("mamba_head", layer.index, tuple(members), {"kv_groups": mixer.num_groups}, renormalise=(norm,))


def mamba_channel_group(view: ModelView, layer: LayerView) -> Group:
    """The head channels of one Mamba-2 layer: unit ``p`` is channel ``p`` of every head."""
    mixer = mamba_view(layer)
    size, heads = mixer.head_dim, mixer.num_heads
    channels = torch.arange(size)[:, None] + torch.arange(heads)[None, :] * size
    members = _members(view, mixer, channels, None)
    norm = f"{view.path_of(mixer.module)}.norm"
    return Group("mamba_channel", layer.index, tuple(members), renormalise=(norm,))


__all__ = ["mamba_channel_group", "mamba_head_group", "mamba_view"]
