"""Physically removing units of a :class:`Group` from a model.

Method note: docs/methods/groups.md.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.layer_kinds import merged_widths
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group, Member
from slimkit.primitives.io.save import config_accepts
from slimkit.primitives.lowrank.module import member_target

RemovableKind = Literal[
    "mlp_channel",
    "attention_head",
    "kv_group",
    "hidden_feature",
    "q_latent",
    "kv_latent",
    "linear_head",
    "linear_kv_group",
    "mamba_head",
    "mamba_channel",
]
"""The group kinds whose units :func:`remove_units` takes out of Hugging Face modules."""
REMOVABLE_KINDS: tuple[str, ...] = get_args(RemovableKind)


class SurgeryError(SlimkitError, ValueError):
    """A keep set or group that surgery refuses, raised before any tensor changes."""


def _kept_positions(length: int, removed: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(length, dtype=torch.bool)
    mask[removed] = False
    return mask.nonzero().flatten()


def _sync_module_attributes(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings, module.embedding_dim = module.weight.shape
    elif isinstance(module, nn.LayerNorm):
        module.normalized_shape = (module.weight.shape[0],)


def sync_config(model: nn.Module) -> None:
    """Write uniform per-layer widths (and the hidden size) into the config when it accepts them."""
    view = ModelView(model)
    merged = merged_widths(view.layer_widths())
    if merged is None:
        return
    values = {**merged, "hidden_size": view.hidden_size}
    if view.spec.model_type == "opt":
        values["word_embed_proj_dim"] = view.hidden_size
    candidate = {**model.config.to_dict(), **values}
    for key in ("model_type", "transformers_version"):
        candidate.pop(key, None)
    if config_accepts(type(model.config), candidate):
        for key, value in values.items():
            setattr(model.config, key, value)


def _where(group: Group) -> str:
    return f"layer {group.layer} {group.kind}" if group.layer is not None else group.kind


def _keep_indices(group: Group, keep: torch.Tensor | list[int]) -> torch.Tensor:
    """``keep`` as a 1-D long tensor, after checking it is a valid set of unit indices."""
    where = _where(group)
    tensor = torch.as_tensor(keep).cpu()  # index sets are small: checked and planned on the CPU
    if tensor.dtype == torch.bool:
        raise SurgeryError(f"{where}: the keep set is a boolean mask; pass the kept unit indices (mask.nonzero())")
    if tensor.is_floating_point() or tensor.is_complex():
        if tensor.is_complex() or not torch.equal(tensor, tensor.round()):
            raise SurgeryError(f"{where}: the keep set must hold integer unit indices, got {tensor.dtype} values")
    if tensor.dim() != 1:
        raise SurgeryError(f"{where}: the keep set must be 1-D unit indices, got shape {tuple(tensor.shape)}")
    tensor = tensor.to(torch.long)
    if tensor.numel() == 0:
        raise SurgeryError(f"{where}: the keep set is empty; at least one of {group.size} units must stay")
    outside = tensor[(tensor < 0) | (tensor >= group.size)]
    if outside.numel():
        raise SurgeryError(
            f"{where}: keep indices {sorted(set(outside.tolist()))[:8]} are outside the group's "
            f"{group.size} units (0..{group.size - 1})"
        )
    values, counts = torch.unique(tensor, return_counts=True)
    if (counts > 1).any():
        raise SurgeryError(f"{where}: the keep set repeats units {values[counts > 1].tolist()[:8]}")
    blocks = int(group.extra.get("kv_groups", 1))  # query heads per KV group, value heads per key head, ...
    if blocks > 1:
        heads = "query heads" if group.kind == "attention_head" else "heads"
        if group.size % blocks:
            raise SurgeryError(f"{where}: {group.size} {heads} do not split evenly over {blocks} KV groups")
        per_block = torch.bincount(tensor // (group.size // blocks), minlength=blocks).tolist()
        if len(set(per_block)) > 1:
            raise SurgeryError(
                f"{where}: the keep set keeps {per_block} {heads} in the {blocks} KV groups; grouped heads need the "
                "same number in every group (see select.keep_top_per_block)"
            )
    return tensor


def _plan_member(group: Group, member: Member, model: nn.Module, removed: torch.Tensor) -> torch.Tensor:
    """The positions ``member``'s parameter keeps along its dimension (checked, nothing changed)."""
    where = _where(group)
    try:
        module = model.get_submodule(member.module)
    except AttributeError:
        raise SurgeryError(f"{where}: member module {member.module!r} is not in the model") from None
    tensor = getattr(module, member.param, None)
    if not isinstance(tensor, torch.Tensor):
        raise SurgeryError(f"{where}: {member.key} is not a parameter of {type(module).__name__}")
    if not -tensor.dim() <= member.dim < tensor.dim():
        raise SurgeryError(f"{where}: {member.key} has no dimension {member.dim} (shape {tuple(tensor.shape)})")
    if member.indices.dim() != 2 or member.indices.shape[0] != group.size:
        raise SurgeryError(
            f"{where}: {member.key} lists units of shape {tuple(member.indices.shape)}, not [{group.size}, per_unit]"
        )
    length = tensor.shape[member.dim]
    if member.indices.numel() and (int(member.indices.min()) < 0 or int(member.indices.max()) >= length):
        raise SurgeryError(
            f"{where}: {member.key} has {length} positions along dim {member.dim} but the group's units reach "
            f"position {int(member.indices.max())}; was the group built before an earlier surgery? Rebuild it"
        )
    positions = _kept_positions(length, member.indices[removed].reshape(-1))
    if positions.numel() == 0:
        raise SurgeryError(
            f"{where}: removing these units would leave {member.key} with no entries along dim {member.dim}"
        )
    return positions


def _planned_rows(layer: LayerView, role: str, new_shapes: dict[int, tuple[int, ...]]) -> int:
    """Output rows of a layer's ``role`` projection once the planned slicing is done."""
    module = layer.linear(role)
    sub_path, name = member_target(module, "weight", 0)
    weight = getattr(module.get_submodule(sub_path) if sub_path else module, name)
    return int(new_shapes.get(id(weight), tuple(weight.shape))[0])


def _check_heads(group: Group, view: ModelView, new_shapes: dict[int, tuple[int, ...]]) -> None:
    """Whole heads and an integer number of query heads per KV head after the planned slicing."""
    layers = view.layers if group.layer is None else [view.layer(group.layer)]
    for layer in layers:
        if layer.spec.q is None or layer.spec.k is None or not layer.has_attention or layer.head_widths is not None:
            continue  # per-head widths are checked by their module (HeadWidthAttention.check)
        if layer.spec.latent_attention is not None:
            continue  # latent attention's head groups hold whole heads of q_b, kv_b and o (groups/latent.py)
        d = layer.head_dim
        q, k = _planned_rows(layer, "q", new_shapes), _planned_rows(layer, "k", new_shapes)
        q //= layer.spec.q_rows_per_head  # a gated query holds query and gate rows per head
        if d <= 0 or q % d or k % d or k == 0 or (q // d) % (k // d):
            raise SurgeryError(
                f"layer {layer.index} {group.kind}: the keep set would leave q with {q} and k with {k} output rows, "
                f"which are not whole heads of {d} with an integer number of query heads per KV head"
            )


def _norm_weight(model: nn.Module, group: Group, path: str) -> torch.Tensor:
    weight = getattr(model.get_submodule(path), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise SurgeryError(f"{_where(group)}: {path} has no 1-D weight to renormalise")
    return weight


def remove_units(model: nn.Module, group: Group, keep: torch.Tensor | list[int]) -> None:
    """Keep units ``keep`` of ``group`` (indices into its units) and remove the rest.

    The keep set and every member are validated first (see the module docstring); a refused keep
    set raises :class:`SurgeryError` and leaves the model unchanged.
    """
    if group.kind not in REMOVABLE_KINDS:
        raise SurgeryError(
            f"group kind '{group.kind}' cannot be removed from HF modules; removable: {', '.join(REMOVABLE_KINDS)}"
        )
    view = ModelView(model)
    kept_units = _keep_indices(group, keep)
    removed_units = _kept_positions(group.size, kept_units)
    planned: list[tuple[nn.Module, Member, torch.Tensor]] = []
    new_shapes: dict[int, tuple[int, ...]] = {}
    done: set[tuple[int, int]] = set()
    for member in group.members:
        positions = _plan_member(group, member, model, removed_units)
        module = model.get_submodule(member.module)
        tensor = getattr(module, member.param)
        dim = member.dim % tensor.dim()
        if (id(tensor), dim) in done:
            continue
        done.add((id(tensor), dim))
        shape = list(new_shapes.get(id(tensor), tuple(tensor.shape)))
        shape[dim] = positions.numel()
        new_shapes[id(tensor)] = tuple(shape)
        planned.append((module, member, positions))
    _check_heads(group, view, new_shapes)
    norm_widths = [(path, _norm_weight(model, group, path).shape[0]) for path in group.renormalise]

    # Nothing above changed the model; from here on every step is a plain slice that cannot fail.
    tied = view.tied
    touched: dict[int, nn.Module] = {}
    for module, member, positions in planned:
        tensor = getattr(module, member.param)
        # Index sets are built on the CPU; the slice stays on the parameter's device, in its dtype.
        kept = tensor.detach().index_select(member.dim, positions.to(tensor.device))
        new = nn.Parameter(kept.clone(), tensor.requires_grad)
        setattr(module, member.param, new)
        touched[id(module)] = module
    for module in touched.values():
        _sync_module_attributes(module)
    for path, before in norm_widths:
        weight = _norm_weight(model, group, path)
        with torch.no_grad():  # the kept channels see the statistic they had beside zeroed ones (groups/mamba.py)
            weight.mul_(math.sqrt(before / weight.shape[0]))
    if tied:
        view.head.weight = view.embed_tokens.weight
        _sync_module_attributes(view.head)
    for layer in view.layers:
        layer.sync_head_counts()
    sync_config(model)
