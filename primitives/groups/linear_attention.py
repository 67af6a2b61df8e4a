"""Coupling groups of a gated DeltaNet (linear-attention) layer: value heads and key-head groups.

Value head ``j`` reads query/key head ``j // r`` (``r = num_v_heads / num_k_heads``) and owns its value rows in the
input projection and their convolution channels, its output-gate rows ``z``, its ``b`` (beta) and ``a`` (decay) rows,
its ``dt_bias`` and ``A_log`` entries and its ``out_proj`` columns. The gated RMSNorm normalises each value head over
its own ``head_v_dim`` with one weight shared by every head, and the delta rule runs per value head, so removing a
value head leaves every kept head computing what it did: removal equals zeroing the head's ``out_proj`` columns.
``linear_head`` units are value heads, kept in equal numbers under every key head (``kv_groups``);
``linear_kv_group`` units are key heads with the value heads they serve (their q and k rows and channels too).

Method note: docs/methods/architectures.md (per-layer kinds).
"""

from __future__ import annotations

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.mixers import DeltaNetView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, Member


def unit_blocks(units: int, width: int, stride: int | None = None, offset: int = 0) -> torch.Tensor:
    """``[units, width]`` positions: unit ``u`` covers ``offset + u * stride + [0, width)``."""
    stride = width if stride is None else stride
    return offset + torch.arange(units)[:, None] * stride + torch.arange(width)[None, :]


def param_members(root: str, module: nn.Module, dim: int, indices: torch.Tensor) -> list[Member]:
    """A module's ``weight`` along ``dim`` and, along the output dimension, its ``bias`` when it has one."""
    members = [Member(root, "weight", dim, indices)]
    if dim == 0 and getattr(module, "bias", None) is not None:
        members.append(Member(root, "bias", 0, indices))
    return members


def deltanet_view(layer: LayerView) -> DeltaNetView:
    mixer = layer.mixer
    if not isinstance(mixer, DeltaNetView):
        raise SlimkitError(f"layer {layer.index} holds no gated DeltaNet")
    return mixer


def _members(view: ModelView, layer: LayerView, units: dict[str, torch.Tensor]) -> list[Member]:
    """The members of one unit set: ``units`` maps each part (``qkv``, ``z``, ``b``, ``a``, ``conv``, ``heads``,
    ``out``) to its ``[units, per_unit]`` positions."""
    mixer = deltanet_view(layer)
    root = f"{view.path_of(mixer.module)}"
    members: list[Member] = []
    if mixer.layout.fused_qkvz:
        members += param_members(f"{root}.in_proj_qkvz", mixer.module.in_proj_qkvz, 0, units["qkvz"])
        members += param_members(f"{root}.in_proj_ba", mixer.module.in_proj_ba, 0, units["ba"])
    else:
        members += param_members(f"{root}.in_proj_qkv", mixer.module.in_proj_qkv, 0, units["conv"])
        members += param_members(f"{root}.in_proj_z", mixer.module.in_proj_z, 0, units["z"])
        members += param_members(f"{root}.in_proj_b", mixer.module.in_proj_b, 0, units["heads"])
        members += param_members(f"{root}.in_proj_a", mixer.module.in_proj_a, 0, units["heads"])
    members += param_members(f"{root}.conv1d", mixer.module.conv1d, 0, units["conv"])
    members += [Member(root, name, 0, units["heads"]) for name in ("dt_bias", "A_log")]
    members += param_members(f"{root}.out_proj", mixer.module.out_proj, 1, units["z"])
    return members


def linear_head_group(view: ModelView, layer: LayerView) -> Group:
    """The value heads of one gated DeltaNet layer (kept in equal numbers under every key head)."""
    mixer = deltanet_view(layer)
    nk, nv, r = mixer.num_k_heads, mixer.num_v_heads, mixer.v_per_k
    dk, dv = mixer.head_k_dim, mixer.head_v_dim
    units = {
        "conv": unit_blocks(nv, dv, offset=2 * nk * dk),
        "z": unit_blocks(nv, dv),
        "heads": unit_blocks(nv, 1),
    }
    if mixer.layout.fused_qkvz:  # per key head g: [q_g, k_g, v_g (r heads), z_g (r heads)]; [b_g (r), a_g (r)]
        stride = 2 * dk + 2 * r * dv
        head = torch.arange(nv)
        start = (head // r) * stride + 2 * dk + (head % r) * dv
        v_rows = start[:, None] + torch.arange(dv)[None, :]
        units["qkvz"] = torch.cat([v_rows, v_rows + r * dv], dim=1)
        b_rows = (head // r) * 2 * r + head % r
        units["ba"] = torch.stack([b_rows, b_rows + r], dim=1)
    return Group("linear_head", layer.index, tuple(_members(view, layer, units)), {"kv_groups": nk})


def linear_kv_group_group(view: ModelView, layer: LayerView) -> Group:
    """The key heads of one gated DeltaNet layer, each with the value heads it serves."""
    mixer = deltanet_view(layer)
    nk, r = mixer.num_k_heads, mixer.v_per_k
    dk, dv = mixer.head_k_dim, mixer.head_v_dim
    key_dim = nk * dk
    q, k = unit_blocks(nk, dk), unit_blocks(nk, dk, offset=key_dim)
    v = unit_blocks(nk, r * dv, offset=2 * key_dim)
    units = {
        "conv": torch.cat([q, k, v], dim=1),
        "z": unit_blocks(nk, r * dv),
        "heads": unit_blocks(nk, r),
    }
    if mixer.layout.fused_qkvz:
        units["qkvz"] = unit_blocks(nk, 2 * dk + 2 * r * dv)
        units["ba"] = unit_blocks(nk, 2 * r)
    return Group("linear_kv_group", layer.index, tuple(_members(view, layer, units)))


__all__ = ["deltanet_view", "linear_head_group", "linear_kv_group_group", "param_members", "unit_blocks"]
