"""Token mixers other than softmax attention, seen through their modules: gated DeltaNet and Mamba-2.

A :class:`MixerView` reads a mixer's widths from its parameter shapes (never the config, which holds the dense values
until save), names the projections that read and write the residual stream, writes back the run-time attributes its
forward reads after a removal (:meth:`MixerView.sync`), and gives a freshly built mixer the saved shapes before the
weights load (:func:`materialise_mixers`). The layouts are data (:mod:`slimkit.primitives.arch.layer_kinds`); the
units these views support are built in :mod:`slimkit.primitives.groups.linear_attention` and
:mod:`slimkit.primitives.groups.mamba`. Method note: docs/methods/architectures.md (per-layer kinds).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch.layer_kinds import DeltaNetLayout, Mamba2Layout


def _count(tensor: torch.Tensor) -> int:
    return int(tensor.shape[0])


def _write(module: nn.Module, values: dict[str, int]) -> None:
    """Set the integer attributes a module's forward reads (torch types a module's attributes as tensors or modules)."""
    for name, value in values.items():
        setattr(module, name, value)


def _sync_conv(conv: nn.Module, channels: int) -> None:
    """A depthwise ``Conv1d`` of ``channels`` channels (its attributes after its weight was sliced)."""
    _write(conv, {"in_channels": channels, "out_channels": channels, "groups": channels})


class MixerView:
    """Shared reading of a non-attention mixer: its module, the projections on the residual stream."""

    kind: str
    readers: tuple[str, ...]
    writer: str = "out_proj"

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def linears(self) -> dict[str, nn.Module]:
        """The projections that read (``in_proj*``) and write (``out_proj``) the residual stream, by name."""
        return {name: self.module.get_submodule(name) for name in (*self.readers, self.writer)}

    def widths(self) -> dict[str, int]:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class DeltaNetView(MixerView):
    """A gated DeltaNet mixer (see :class:`DeltaNetLayout` for its layout)."""

    kind = "gated_deltanet"

    def __init__(self, module: nn.Module, layout: DeltaNetLayout) -> None:
        super().__init__(module)
        self.layout = layout
        self.readers = layout.readers

    @property
    def head_k_dim(self) -> int:
        return int(self.module.head_k_dim)

    @property
    def head_v_dim(self) -> int:
        return int(self.module.head_v_dim)

    @property
    def num_v_heads(self) -> int:
        return _count(self.module.A_log)

    @property
    def num_k_heads(self) -> int:
        channels = _count(self.module.conv1d.weight)
        return (channels - self.num_v_heads * self.head_v_dim) // (2 * self.head_k_dim)

    @property
    def v_per_k(self) -> int:
        """Value heads per query/key head."""
        return self.num_v_heads // self.num_k_heads

    def widths(self) -> dict[str, int]:
        return {self.layout.v_heads_key: self.num_v_heads, self.layout.k_heads_key: self.num_k_heads}

    def sync(self) -> None:
        nv, nk = self.num_v_heads, self.num_k_heads
        if nk <= 0 or nv % nk:
            raise ValueError(f"{nv} value heads cannot be grouped over {nk} key heads")
        key_dim, value_dim = nk * self.head_k_dim, nv * self.head_v_dim
        conv_dim = 2 * key_dim + value_dim
        values = {"num_v_heads": nv, "num_k_heads": nk, "key_dim": key_dim, "value_dim": value_dim}
        _write(self.module, {**values, "conv_dim": conv_dim})
        _sync_conv(self.module.conv1d, conv_dim)


class Mamba2View(MixerView):
    """A Mamba-2 mixer (see :class:`Mamba2Layout` for its layout)."""

    kind = "mamba2"
    readers = ("in_proj",)

    def __init__(self, module: nn.Module, layout: Mamba2Layout) -> None:
        super().__init__(module)
        self.layout = layout

    @property
    def num_heads(self) -> int:
        return _count(self.module.A_log)

    @property
    def head_dim(self) -> int:
        """Channels per head (the width over the head count: head channels may have been removed)."""
        return self.intermediate_size // self.num_heads

    @property
    def state_size(self) -> int:
        return int(self.module.ssm_state_size)

    @property
    def intermediate_size(self) -> int:
        """The mixer's width: heads x head_dim (``out_proj``'s input)."""
        return int(self.module.out_proj.in_features)

    @property
    def num_groups(self) -> int:
        return (_count(self.module.conv1d.weight) - self.intermediate_size) // (2 * self.state_size)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def widths(self) -> dict[str, int]:
        layout = self.layout
        return {
            layout.heads_key: self.num_heads,
            layout.groups_key: self.num_groups,
            layout.head_dim_key: self.head_dim,
        }

    def sync(self) -> None:
        heads, groups, width = self.num_heads, self.num_groups, self.intermediate_size
        if groups <= 0 or heads % groups or width != heads * self.head_dim:
            raise ValueError(f"{heads} Mamba heads of {self.head_dim} do not fill {groups} SSM groups of width {width}")
        conv_dim = width + 2 * groups * self.state_size
        values = {"num_heads": heads, "n_groups": groups, "intermediate_size": width, "head_dim": self.head_dim}
        _write(self.module, {**values, "conv_dim": conv_dim})
        _sync_conv(self.module.conv1d, conv_dim)
        _write(self.module.norm, {"group_size": width // groups})


def materialise_mixer(mixer: nn.Module, prefix: str, saved: dict[str, tuple[int, ...]]) -> bool:
    """Give ``mixer``'s own parameters (``A_log``, ``dt_bias``, ``D``) and its ``conv1d`` and ``norm`` parameters the
    saved shapes (``prefix``: the mixer's path in the checkpoint); its Linears are left to the generic materialisation.
    Returns whether anything changed."""
    changed = False
    for owner_path in ("", "conv1d", "norm"):
        owner = mixer.get_submodule(owner_path) if owner_path else mixer
        for name, param in list(owner.named_parameters(recurse=False)):
            key = ".".join(part for part in (prefix, owner_path, name) if part)
            shape = saved.get(key)
            if shape is not None and tuple(param.shape) != tuple(shape):
                empty = torch.empty(shape, dtype=param.dtype, device=param.device)
                setattr(owner, name, nn.Parameter(empty, param.requires_grad))
                changed = True
    return changed


def mixer_views(model: nn.Module) -> list[tuple[str, MixerView]]:
    """``(path in the model, view)`` of every gated DeltaNet and Mamba-2 mixer of a hybrid (none elsewhere)."""
    from slimkit.primitives.arch.spec import ARCH_SPECS  # spec imports layer_kinds only; views import this module

    config = getattr(model, "config", None)
    spec = ARCH_SPECS.get(getattr(config, "model_type", None) or "")
    if spec is None or spec.layer_kinds is None:
        return []
    kinds = spec.layer_kinds
    layers = model.base_model.get_submodule(spec.layers)
    prefix = {id(module): name for name, module in model.named_modules()}
    found: list[tuple[str, MixerView]] = []
    for index, layer in enumerate(layers):
        mixer = kinds.kind_of(config, index).mixer
        view: MixerView | None = None
        if mixer == "gated_deltanet" and kinds.deltanet is not None:
            view = DeltaNetView(layer.get_submodule(kinds.deltanet.path), kinds.deltanet)
        elif mixer == "mamba2" and kinds.mamba is not None:
            view = Mamba2View(layer.get_submodule(kinds.mamba.path), kinds.mamba)
        if view is not None:
            found.append((prefix[id(view.module)], view))
    return found


def materialise_mixers(model: nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
    """Give every mixer of a freshly built hybrid the saved shapes of its own, ``conv1d`` and ``norm`` parameters
    before the weights load (per-layer head counts; the Linears are materialised with the rest of the model); the
    run-time attributes follow once the Linears have their shapes too (``LayerView.sync_head_counts``)."""
    for path, view in mixer_views(model):
        materialise_mixer(view.module, path, saved)


def hybrid_part_params(config: Any) -> tuple[int, int, int] | None:
    """A hybrid's parameters of token mixing (attention, gated DeltaNet and Mamba-2 mixers), of the feed-forward
    blocks and of the norms inside its layers, counted on the model its config builds on the meta device (no memory,
    exact whatever the layer pattern); None for a model whose layers are all alike (or a config not a hybrid's)."""
    from slimkit.primitives.arch.spec import ARCH_SPECS

    spec = ARCH_SPECS.get(getattr(config, "model_type", None) or "")
    if spec is None or spec.layer_kinds is None or not hasattr(config, "to_dict"):
        return None
    import transformers

    from slimkit.primitives.evaluate.counting import params_by_part  # counting views the model through arch

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if spec.fused:
        from slimkit.primitives.arch.fused import split_fused

        split_fused(model)
    parts = params_by_part(model)
    norms = parts["layers"] - parts["attention"] - parts["mlp"]  # the layers' norms (q/k norms too)
    return parts["attention"], parts["mlp"], norms


__all__ = [
    "DeltaNetView",
    "Mamba2View",
    "MixerView",
    "hybrid_part_params",
    "materialise_mixer",
    "materialise_mixers",
    "mixer_views",
]
