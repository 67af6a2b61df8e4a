"""Masks applied to a Hugging Face model by hooks (SP3 Eq. 9, Appendix F).

:func:`apply_masks` multiplies module inputs and outputs by forward hooks and pre-hooks (never a copied forward pass),
with the hidden masks in the ``norm``, ``linear`` or ``stream`` placement.

Method note: docs/methods/masks-hard-concrete.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.mask_set import (
    MaskSet,
    MaskShape,
    MaskValues,
    check_layer_groups,
)
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE

MaskSite = Literal["auto", "norm", "linear", "stream"]
MASK_SITES: tuple[str, ...] = ("auto", "norm", "linear", "stream")


# -- hooks ------------------------------------------------------------------------------------------


@dataclass
class MaskHooks:
    """Handles of the hooks :func:`apply_masks` registered; ``remove()`` or use as a context manager."""

    handles: list[RemovableHandle] = field(default_factory=list)
    values: MaskValues | None = None
    """The mask values the hooks use now (refreshed at every root forward when the source is a MaskSet)."""

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> MaskHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


Getter = Callable[[], torch.Tensor | None]


def _eq34_boundary(layer: nn.Module) -> bool:
    """Whether ``layer`` ends a Group PCA group in Eq. 34's form (its down projection writes the next basis)."""
    adapter = layer._modules.get("basis_change")
    return adapter is not None and getattr(adapter, "hook", None) == "branch"


def _times(*getters: Getter) -> Getter:
    def get() -> torch.Tensor | None:
        out = None
        for g in getters:
            z = g()
            if z is not None:
                out = z if out is None else out * z
        return out

    return get


def _scale(x: torch.Tensor, z: torch.Tensor, heads: int | None) -> torch.Tensor:
    z = z.to(device=x.device, dtype=x.dtype)
    if heads is None:
        return x * z
    return (x.unflatten(-1, (heads, -1)) * z).flatten(-2)


def _pre_hook(get: Getter, heads: int | None = None):
    def hook(module: nn.Module, args: tuple):
        z = get()
        if z is None or not args:
            return None
        return (_scale(args[0], z, heads), *args[1:])

    return hook


def _out_hook(get: Getter, heads: int | None = None):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        z = get()
        return None if z is None else _scale(output, z, heads)

    return hook


def _kept_prefix(get: Getter, width: int) -> Getter:
    """0/1 over ``width`` coordinates keeping the first as many as ``get()`` has non-zero entries (an own embedding
    basis is in decreasing order of variance: the embedding keeps its top components, as many as group 1 keeps)."""

    def prefix() -> torch.Tensor | None:
        z = get()
        if z is None:
            return None
        kept = min(int((z != 0).sum()), width)
        return (torch.arange(width, device=z.device) < kept).to(z.dtype)

    return prefix


def _layer_input_hook(get: Getter):
    """Pre-hook on a whole layer: masks its ``hidden_states`` (first positional or keyword argument)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        z = get()
        if z is None:
            return None
        if args:
            return (_scale(args[0], z, None), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _scale(kwargs["hidden_states"], z, None)}

    return hook


def resolve_mask_site(
    view: ModelView, placement: MaskSite = "auto", *, grouped: bool = False
) -> Literal["norm", "linear", "stream"]:
    """``auto``: ``norm`` for post-norm models (BERT); for pre-norm ones (llama, OPT) ``stream`` with
    per-group hidden masks (``grouped``), ``linear`` otherwise."""
    if placement not in MASK_SITES:
        raise SlimkitError(f"unknown mask placement '{placement}'; allowed: {', '.join(MASK_SITES)}")
    post = view.spec.norm_placement == "post"
    if placement == "auto":
        return "norm" if post else "stream" if grouped else "linear"
    if placement == "norm" and not post:
        raise SlimkitError("mask placement 'norm' needs a post-norm model (BERT); use 'linear' for pre-norm models")
    if placement == "stream" and post:
        raise SlimkitError("mask placement 'stream' needs a pre-norm model (llama, OPT); use 'norm' for BERT")
    return placement


def apply_masks(
    model: nn.Module | ModelView,
    source: MaskSet | MaskValues,
    *,
    placement: MaskSite = "auto",
    groups: Sequence[Sequence[int]] | None = None,
    ends: bool | None = None,
) -> MaskHooks:
    """Register hooks that multiply the model's activations by the masks (see the module docstring).

    ``source`` is a :class:`MaskSet` (masks drawn once per root-model call, gradients flow to its
    ``log_alpha``) or fixed :class:`MaskValues`. Returns the handles; ``with apply_masks(...):``
    removes them on exit. The model's own forward code runs unchanged. ``groups`` (the layer groups
    of the ``stream`` placement) default to the mask set's; fixed values in that placement need them.
    ``ends`` (``norm`` placement only; default: on for a ``per_norm`` mask set) also masks the first
    hidden norm's input by ``mha_in[0]`` and the last one's output by ``ffn_out[L−1]``.
    """
    view = model if isinstance(model, ModelView) else ModelView(model)
    if groups is None and isinstance(source, MaskSet):
        groups = source.groups
    where = resolve_mask_site(view, placement, grouped=groups is not None)
    if where == "stream":
        groups = check_layer_groups(groups, view.num_layers)
    shape = MaskShape.from_view(view)
    if isinstance(source, MaskSet) and source.shape != shape:
        raise SlimkitError(f"the mask set was built for {source.shape}, the model has {shape}")
    if ends is None:
        ends = isinstance(source, MaskSet) and source.hidden_mode == "per_norm"
    if ends and where != "norm":
        raise SlimkitError("ends: masking the first norm's input and the last norm's output needs the 'norm' placement")
    hooks = MaskHooks()
    if isinstance(source, MaskValues):
        source.check(shape)
        hooks.values = source
    else:

        def refresh(module: nn.Module, args: tuple) -> None:
            hooks.values = source()

        hooks.handles.append(view.model.register_forward_pre_hook(refresh))

    def value(name: str, layer: int) -> Getter:
        def get() -> torch.Tensor | None:
            if hooks.values is None:
                hooks.values = source()
            values = getattr(hooks.values, name)
            return None if values is None else values[layer]

        return get

    def value_2d(name: str, layer: int) -> Getter:
        get = value(name, layer)

        def get_2d() -> torch.Tensor | None:
            z = get()
            return None if z is None else z.unsqueeze(-1)

        return get_2d

    def pre(module: nn.Module, get: Getter, heads: int | None = None) -> None:
        hooks.handles.append(module.register_forward_pre_hook(_pre_hook(get, heads)))

    def post(module: nn.Module, get: Getter, heads: int | None = None) -> None:
        hooks.handles.append(module.register_forward_hook(_out_hook(get, heads)))

    for i, layer in enumerate(view.layers):
        heads = layer.num_heads
        post(layer.linear("q"), _times(value("q", i), value("qk", i)), heads)  # z_QK once: on the query side
        post(layer.linear("k"), value("k", i), layer.num_kv_heads)
        post(layer.linear("v"), _times(value("v", i), value("vo", i)), layer.num_kv_heads)  # z_VO once: on v
        pre(layer.linear("o"), _times(value_2d("head", i), value("o", i)), heads)
        pre(layer.linear("down"), value("f", i))
        if where == "stream":
            if i in {group[0] for group in groups}:
                handle = layer.module.register_forward_pre_hook(_layer_input_hook(value("mha_in", i)), with_kwargs=True)
                hooks.handles.append(handle)
            post(layer.linear("o"), _times(value("mha", i), value("mha_out", i)))
            if _eq34_boundary(layer.module):  # writes the next group's stream, gated where that group starts
                post(layer.linear("down"), value("ffn", i))
            else:
                post(layer.linear("down"), _times(value("ffn", i), value("ffn_out", i)))
        elif where == "linear":
            for role in ("q", "k", "v"):
                pre(layer.linear(role), value("mha_in", i))
            for role in layer.mlp_input_roles:
                pre(layer.linear(role), value("ffn_in", i))
            post(layer.linear("o"), _times(value("mha", i), value("mha_out", i)))
            post(layer.linear("down"), _times(value("ffn", i), value("ffn_out", i)))
        else:
            post(layer.linear("o"), value("mha", i))
            post(layer.linear("down"), value("ffn", i))
            pre(layer.attn_norm.module, value("mha_out", i))
            post(layer.attn_norm.module, value("ffn_in", i))
            pre(layer.mlp_norm.module, value("ffn_out", i))
            if i > 0:
                post(view.layer(i - 1).mlp_norm.module, value("mha_in", i))
            elif view.spec.extra_norms:
                post(view.base.get_submodule(view.spec.extra_norms[-1]), value("mha_in", 0))
            else:
                handle = layer.module.register_forward_pre_hook(_layer_input_hook(value("mha_in", 0)), with_kwargs=True)
                hooks.handles.append(handle)
    if ends:
        if not view.spec.extra_norms:
            raise SlimkitError("ends: the model has no norm before its first layer")
        pre(view.base.get_submodule(view.spec.extra_norms[-1]), value("mha_in", 0))
        post(view.layer(view.num_layers - 1).mlp_norm.module, value("ffn_out", view.num_layers - 1))
    if where == "stream" and view.tied and view.final_norm is not None:
        if BASIS_CHANGE in view.embed_tokens._modules:
            # the tied embedding has its own basis (its map into group 1's sits on its output): both uses keep
            # its top coordinates, as many as group 1 keeps, before the map and after the final norm's map
            prefix = _kept_prefix(value("mha_in", 0), view.embed_tokens.weight.shape[1])
            hooks.handles.append(view.embed_tokens.register_forward_hook(_out_hook(prefix), prepend=True))
            post(view.final_norm.module, prefix)
        else:
            post(view.final_norm.module, value("mha_in", 0))
    return hooks
