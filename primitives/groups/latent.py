"""Coupling groups of multi-head latent attention (:mod:`slimkit.primitives.arch.latent_attention`): heads with their
rotary and non-rotary query parts, keys and values, and the query and key-value latent channels.

Method note: docs/methods/groups.md.
"""

from __future__ import annotations

import torch

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.latent_attention import LatentAttention, latent_widths
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, Member, blocks, linear_members

LATENT_KINDS = ("q_latent", "kv_latent")
"""The latent channel unit kinds (MLA only)."""


def _latent(view: ModelView, kind: str) -> LatentAttention:
    latent = view.spec.latent_attention
    if latent is None:
        raise SlimkitError(
            f"{kind} groups are not supported for {view.spec.model_type}: it has no latent attention (MLA)"
        )
    return latent


def _path(view: ModelView, layer: LayerView, latent_path: str) -> str:
    return f"{view.path_of(layer.attention)}.{latent_path}"


def latent_head_group(view: ModelView, layer: LayerView) -> Group:
    """One unit per head: its ``q_b`` rows (non-rotary and rotary), its ``kv_b`` rows (key and value), its ``o``
    columns."""
    latent = _latent(view, "attention_head")
    widths = latent_widths(layer.attention, latent)
    attention = layer.attention
    members = linear_members(
        _path(view, layer, latent.q_b), attention.get_submodule(latent.q_b), 0, blocks(widths.heads, widths.query_head)
    )
    members += linear_members(
        _path(view, layer, latent.kv_b), attention.get_submodule(latent.kv_b), 0, blocks(widths.heads, widths.kv_head)
    )
    members += linear_members(
        _path(view, layer, latent.o), attention.get_submodule(latent.o), 1, blocks(widths.heads, widths.value)
    )
    return Group("attention_head", layer.index, tuple(members), {"kv_groups": 1})


def _norm_member(view: ModelView, layer: LayerView, path: str, units: torch.Tensor) -> Member:
    return Member(_path(view, layer, path), "weight", 0, units)


def q_latent_group(view: ModelView, layer: LayerView) -> Group:
    """One unit per query latent channel: a ``q_a`` row, its ``q_a_layernorm`` weight, a ``q_b`` column."""
    latent = _latent(view, "q_latent")
    attention = layer.attention
    units = blocks(latent_widths(attention, latent).q_rank, 1)
    members = linear_members(_path(view, layer, latent.q_a), attention.get_submodule(latent.q_a), 0, units)
    members.append(_norm_member(view, layer, latent.q_a_norm, units))
    members += linear_members(_path(view, layer, latent.q_b), attention.get_submodule(latent.q_b), 1, units)
    return Group("q_latent", layer.index, tuple(members), renormalise=(_path(view, layer, latent.q_a_norm),))


def kv_latent_group(view: ModelView, layer: LayerView) -> Group:
    """One unit per key-value latent channel: one of ``kv_a``'s first ``kv_lora_rank`` rows (the rotary key rows
    after them stay), its ``kv_a_layernorm`` weight, a ``kv_b`` column."""
    latent = _latent(view, "kv_latent")
    attention = layer.attention
    units = blocks(latent_widths(attention, latent).kv_rank, 1)
    members = linear_members(_path(view, layer, latent.kv_a), attention.get_submodule(latent.kv_a), 0, units)
    members.append(_norm_member(view, layer, latent.kv_a_norm, units))
    members += linear_members(_path(view, layer, latent.kv_b), attention.get_submodule(latent.kv_b), 1, units)
    return Group("kv_latent", layer.index, tuple(members), renormalise=(_path(view, layer, latent.kv_a_norm),))


__all__ = ["LATENT_KINDS", "kv_latent_group", "latent_head_group", "q_latent_group"]
