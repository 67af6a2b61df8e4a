"""Coupling groups: the units that must be removed together.

A :class:`Group` lists the (projection role, dimension) pairs of one layer that share an index:
removing unit ``i`` removes index ``i`` along ``dim`` of every member (``dim=0``: output rows,
``dim=1``: input columns). This module has the MLP-channel group; the pruning-core issue adds
heads, KV groups, QK/VO dims, hidden features and the torch-pruning builder on the same type.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole


@dataclass(frozen=True)
class Member:
    role: LinearRole
    dim: int


@dataclass(frozen=True)
class Group:
    kind: str
    layer: int
    members: tuple[Member, ...]
    size: int
    """Number of units (e.g. MLP channels) in the group."""


def mlp_channel_group(layer: LayerView) -> Group:
    """MLP channel ``i``: row ``i`` of gate and up (or fc1), column ``i`` of down (or fc2)."""
    members = (*(Member(role, 0) for role in layer.mlp_input_roles), Member("down", 1))
    return Group(kind="mlp_channel", layer=layer.index, members=members, size=layer.mlp_width)


__all__ = ["Group", "Member", "mlp_channel_group"]
