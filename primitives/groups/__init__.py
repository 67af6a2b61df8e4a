"""Coupling groups: the units that must be removed together.

One :class:`Group` type: the parameters (:class:`Member` s) a unit occupies and where, so removing or scoring unit
``u`` acts on every member at once.

Method note: docs/methods/groups.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.capabilities import check_operation
from slimkit.primitives.arch.layer_kinds import ATTENTION_AND_MLP, MIXER_LABELS
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import member_target

GROUP_KINDS = (
    "mlp_channel",
    "attention_head",
    "kv_group",
    "qk_dim",
    "vo_dim",
    "hidden_feature",
    "q_latent",
    "kv_latent",
    "linear_head",
    "linear_kv_group",
    "mamba_head",
    "mamba_channel",
)


@dataclass(frozen=True, eq=False)
class Member:
    module: str
    """Module path inside the model (``model.get_submodule(module)``)."""
    param: str
    """Parameter name on that module (``weight`` or ``bias``)."""
    dim: int
    indices: torch.Tensor
    """``[units, per_unit]`` positions along ``dim`` that each unit occupies."""

    def tensor(self, model: nn.Module) -> torch.Tensor:
        return getattr(model.get_submodule(self.module), self.param)

    @property
    def key(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param


@dataclass(frozen=True, eq=False)
class Group:
    kind: str
    layer: int | None
    """Layer index, or None for model-wide groups (hidden features)."""
    members: tuple[Member, ...]
    extra: dict = field(default_factory=dict)
    """Kind-specific facts selection needs (e.g. ``kv_groups`` for attention heads)."""
    renormalise: tuple[str, ...] = ()
    """Norms (module paths) whose statistic averages over the units' channels in groups the removal shrinks evenly
    (Mamba-2's gated RMSNorm, MLA's latent norms): removal multiplies each one's weight by ``sqrt(width before /
    width after)``, so the kept channels see the statistic they had with the removed ones zero
    (:mod:`slimkit.primitives.groups.mamba`, :mod:`slimkit.primitives.groups.latent`)."""

    @property
    def size(self) -> int:
        return int(self.members[0].indices.shape[0])

    def distinct_members(self, model: nn.Module) -> list[tuple[Member, torch.Tensor]]:
        """``(member, parameter)`` once per distinct (parameter, dimension): tied members count once."""
        found: list[tuple[Member, torch.Tensor]] = []
        seen: set[tuple[int, int]] = set()
        for member in self.members:
            tensor = member.tensor(model)
            if (id(tensor), member.dim) not in seen:
                seen.add((id(tensor), member.dim))
                found.append((member, tensor))
        return found

    def unit_slices(self, model: nn.Module) -> list[tuple[torch.Tensor, int]]:
        """``(parameter, elements one unit removes from it)`` per distinct parameter (tied ones once)."""
        slices: list[tuple[torch.Tensor, int]] = []
        seen: set[int] = set()
        for member in self.members:
            tensor = member.tensor(model)
            if id(tensor) not in seen:
                seen.add(id(tensor))
                slices.append((tensor, member.indices.shape[1] * (tensor.numel() // tensor.shape[member.dim])))
        return slices

    def params_per_unit(self, model: nn.Module) -> int:
        """Parameters removed with one unit."""
        return sum(per_unit for _tensor, per_unit in self.unit_slices(model))


def _blocks(units: int, width: int, stride: int | None = None, offset: int = 0) -> torch.Tensor:
    """``[units, width]`` contiguous blocks: unit u covers offset + u*stride + [0, width)."""
    stride = width if stride is None else stride
    return offset + torch.arange(units)[:, None] * stride + torch.arange(width)[None, :]


def _linear_members(path: str, module: nn.Module, dim: int, indices: torch.Tensor) -> list[Member]:
    """The weight along ``dim`` and, for output dimensions, the bias along 0.

    A low-rank pair keeps its output dimension in ``second`` and its input dimension in ``first``.
    """

    def member(param: str, along: int) -> Member:
        sub_path, name = member_target(module, param, along)
        return Member(f"{path}.{sub_path}" if sub_path else path, name, along, indices)

    members = [member("weight", dim)]
    if dim == 0 and getattr(module, "bias", None) is not None:
        members.append(member("bias", 0))
    return members


blocks = _blocks
linear_members = _linear_members


def _head_param_members(view: ModelView, layer: LayerView, units: torch.Tensor) -> list[Member]:
    """Parameters with one entry per query head (GPT-OSS's sinks), ``units`` ``[units, heads per unit]``."""
    base = view.path_of(layer.module)
    return [
        Member(f"{base}.{path.rpartition('.')[0]}", path.rpartition(".")[2], 0, units)
        for path in layer.spec.head_params
    ]


def _layer_path(view: ModelView, layer: LayerView, role: LinearRole) -> str:
    return f"{view.path_of(layer.module)}.{layer.linear_path(role)}"


def mlp_channel_group(view: ModelView, layer: LayerView) -> Group:
    units = _blocks(int(layer.linear("up").out_features), 1)  # a routed layer's shared expert has its own width
    members: list[Member] = []
    for role in layer.mlp_input_roles:
        members += _linear_members(_layer_path(view, layer, role), layer.linear(role), 0, units)
    members += _linear_members(_layer_path(view, layer, "down"), layer.linear("down"), 1, units)
    return Group("mlp_channel", layer.index, tuple(members))


def attention_head_group(view: ModelView, layer: LayerView) -> Group:
    if view.spec.latent_attention is not None:
        from slimkit.primitives.groups.latent import latent_head_group  # it builds on this module

        return latent_head_group(view, layer)
    if layer.num_kv_heads == layer.num_heads:  # no GQA: a head owns its key and value too
        return Group("attention_head", layer.index, kv_group_group(view, layer).members, {"kv_groups": 1})
    units = _blocks(layer.num_heads, layer.head_dim)
    q_units = _blocks(layer.num_heads, layer.head_dim * layer.spec.q_rows_per_head)  # a gated query: query and gate
    members = _linear_members(_layer_path(view, layer, "q"), layer.linear("q"), 0, q_units)
    members += _linear_members(_layer_path(view, layer, "o"), layer.linear("o"), 1, units)
    members += _head_param_members(view, layer, _blocks(layer.num_heads, 1))
    return Group("attention_head", layer.index, tuple(members), {"kv_groups": layer.num_kv_heads})


def kv_group_group(view: ModelView, layer: LayerView) -> Group:
    d, kv = layer.head_dim, layer.num_kv_heads
    per_group = layer.num_heads // kv
    q_units, kv_units = _blocks(kv, per_group * d), _blocks(kv, d)
    gated_q = _blocks(kv, per_group * d * layer.spec.q_rows_per_head)  # a gated query: query and gate per head
    members = _linear_members(_layer_path(view, layer, "q"), layer.linear("q"), 0, gated_q)
    members += _linear_members(_layer_path(view, layer, "k"), layer.linear("k"), 0, kv_units)
    members += _linear_members(_layer_path(view, layer, "v"), layer.linear("v"), 0, kv_units)
    members += _linear_members(_layer_path(view, layer, "o"), layer.linear("o"), 1, q_units)
    members += _head_param_members(view, layer, _blocks(kv, per_group))
    return Group("kv_group", layer.index, tuple(members))


def _dims_across_heads(heads: int, head_dim: int, dims: torch.Tensor) -> torch.Tensor:
    """``[units, heads * per_unit]``: unit u's positions ``dims[u]`` inside every head."""
    offsets = torch.arange(heads)[None, :, None] * head_dim
    return (offsets + dims[:, None, :]).reshape(dims.shape[0], -1)


def qk_dim_group(view: ModelView, layer: LayerView) -> Group:
    check_operation(layer.spec, "qk_dim", view.config)
    d = layer.head_dim
    if layer.rope and layer.spec.rope_pairs == "adjacent":  # interleaved RoPE rotates 2j with 2j + 1
        dims = torch.arange(d).reshape(d // 2, 2)
    elif layer.rope:  # rotate_half pairs dimension j with j + d/2
        dims = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1)
    else:
        dims = torch.arange(d)[:, None]
    q = _dims_across_heads(layer.num_heads, d, dims)
    k = _dims_across_heads(layer.num_kv_heads, d, dims)
    members = _linear_members(_layer_path(view, layer, "q"), layer.linear("q"), 0, q)
    members += _linear_members(_layer_path(view, layer, "k"), layer.linear("k"), 0, k)
    return Group("qk_dim", layer.index, tuple(members), {"rope_pairs": layer.rope})


def vo_dim_group(view: ModelView, layer: LayerView) -> Group:
    d = layer.head_dim
    dims = torch.arange(d)[:, None]
    members = _linear_members(
        _layer_path(view, layer, "v"), layer.linear("v"), 0, _dims_across_heads(layer.num_kv_heads, d, dims)
    )
    members += _linear_members(
        _layer_path(view, layer, "o"), layer.linear("o"), 1, _dims_across_heads(layer.num_heads, d, dims)
    )
    return Group("vo_dim", layer.index, tuple(members))


def hidden_feature_group(view: ModelView) -> Group:
    units = _blocks(view.hidden_size, 1)
    members: list[Member] = [Member(view.path_of(view.embed_tokens), "weight", 1, units)]
    for path in view.spec.extra_embeddings:
        members.append(Member(view.path_of(view.base.get_submodule(path)), "weight", 1, units))
    norms = [view.base.get_submodule(path) for path in view.spec.extra_norms]
    for layer in view.layers:
        for role in layer.roles:
            reads_stream = role not in ("o", "down")
            members += _linear_members(
                _layer_path(view, layer, role), layer.linear(role), 1 if reads_stream else 0, units
            )
        mixer = layer.mixer  # a hybrid's gated DeltaNet / Mamba-2 mixer: in_proj* read the stream, out_proj writes it
        if mixer is not None:
            for name, linear in mixer.linears().items():
                members += _linear_members(view.path_of(linear), linear, 0 if name == mixer.writer else 1, units)
        norms += layer.norms
    if view.final_norm is not None:
        norms.append(view.final_norm.module)
    for norm in norms:
        path = view.path_of(norm)
        members += [Member(path, name, 0, units) for name, _ in norm.named_parameters(recurse=False)]
    head = view.head
    if head is not None and not view.tied:
        members.append(Member(view.path_of(head), "weight", 1, units))
    return Group("hidden_feature", None, tuple(members))


def _q_latent(view: ModelView, layer: LayerView) -> Group:
    from slimkit.primitives.groups.latent import q_latent_group

    return q_latent_group(view, layer)


def _kv_latent(view: ModelView, layer: LayerView) -> Group:
    from slimkit.primitives.groups.latent import kv_latent_group

    return kv_latent_group(view, layer)


def _layer_builders() -> dict[str, Callable[[ModelView, LayerView], Group]]:
    from slimkit.primitives.groups.linear_attention import linear_head_group, linear_kv_group_group
    from slimkit.primitives.groups.mamba import mamba_channel_group, mamba_head_group

    return {
        "mlp_channel": mlp_channel_group,
        "attention_head": attention_head_group,
        "kv_group": kv_group_group,
        "qk_dim": qk_dim_group,
        "vo_dim": vo_dim_group,
        "q_latent": _q_latent,
        "kv_latent": _kv_latent,
        "linear_head": linear_head_group,
        "linear_kv_group": linear_kv_group_group,
        "mamba_head": mamba_head_group,
        "mamba_channel": mamba_channel_group,
    }


GROUP_BLOCK = {
    "mlp_channel": "mlp",
    "attention_head": "attention",
    "kv_group": "attention",
    "qk_dim": "attention",
    "vo_dim": "attention",
    "q_latent": "attention",
    "kv_latent": "attention",
    "linear_head": "gated_deltanet",
    "linear_kv_group": "gated_deltanet",
    "mamba_head": "mamba2",
    "mamba_channel": "mamba2",
}
"""The sub-block (or token mixer) each layer group kind lives in: a layer without it (a removed block, a hybrid's layer
of another kind) has no groups of that kind."""


def holds(layer: LayerView, block: str) -> bool:
    """Whether ``layer`` holds ``block`` now (``attention``, ``mlp`` or a mixer kind of :data:`GROUP_BLOCK`)."""
    if block == "attention":
        return layer.has_attention
    if block == "mlp":
        return layer.has_mlp
    return layer.kind.mixer == block


def build_groups(model: nn.Module, kind: str, layers: list[int] | None = None) -> list[Group]:
    """Groups of ``kind`` from the model's :class:`ModelView` (all layers unless ``layers`` is given).

    Layers whose sub-block of that kind was removed (:mod:`slimkit.primitives.blocks`) have nothing left to
    remove and give no group."""
    view = ModelView(model)
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind '{kind}'; allowed: {', '.join(GROUP_KINDS)}")
    check_operation(view.spec, kind, view.config)
    if kind == "hidden_feature":
        return [hidden_feature_group(view)]
    indices = range(view.num_layers) if layers is None else layers
    chosen = [view.layer(i) for i in indices]
    if GROUP_BLOCK[kind] == "attention":
        uneven = [layer.index for layer in chosen if layer.head_widths is not None]
        if uneven:
            raise SlimkitError(
                f"{kind} groups need heads of one width; layer(s) {', '.join(map(str, uneven))} keep per-head widths "
                "(SP3's MHA-intermediate masks), so their attention units cannot be pruned further"
            )
    builder = _layer_builders()[kind]
    return [builder(view, layer) for layer in chosen if holds(layer, GROUP_BLOCK[kind])]


def layer_group(model: nn.Module, kind: str, layer: int) -> Group:
    groups = build_groups(model, kind, [layer])
    if not groups:
        view = ModelView(model)
        block = GROUP_BLOCK[kind]
        if block in ("attention", "mlp") and view.layer(layer).kind == ATTENTION_AND_MLP:
            raise SlimkitError(f"layer {layer} has no {kind} units: its {block} block was removed")
        raise SlimkitError(f"layer {layer} has no {kind} units: it holds no {MIXER_LABELS.get(block, block)}")
    return groups[0]


__all__ = [
    "GROUP_BLOCK",
    "GROUP_KINDS",
    "Group",
    "Member",
    "blocks",
    "build_groups",
    "hidden_feature_group",
    "holds",
    "layer_group",
    "linear_members",
    "mlp_channel_group",
]
