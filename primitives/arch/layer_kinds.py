"""Per-layer kinds as data: which token mixer and whether a feed-forward block each decoder layer holds.

A hybrid decoder builds each layer from a per-layer list in its config (Qwen 3.5's and Qwen3-Next's ``layer_types``,
Nemotron-H's and Granite 4.0-H's ``layers_block_type``). :class:`LayerKinds` maps each value of that list to a
:class:`LayerKind`: the token mixer the layer holds (softmax ``attention`` at the spec's attention paths, a gated
DeltaNet or a Mamba-2 mixer at the layout's path) and whether it holds the spec's feed-forward block. Nothing here
reads a forward pass: a :class:`~slimkit.primitives.arch.view.LayerView` asks its kind which of the spec's paths
exist in that layer. Method note: docs/methods/architectures.md (per-layer kinds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from slimkit.primitives.errors import SlimkitError

MixerKind = Literal["attention", "gated_deltanet", "mamba2"]
MIXER_LABELS: dict[str, str] = {
    "attention": "softmax attention",
    "gated_deltanet": "gated DeltaNet (linear attention)",
    "mamba2": "Mamba-2",
}
"""How a message names each token mixer."""


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer holds."""

    mixer: MixerKind | None
    """The token mixer (None: a layer with a feed-forward block only, Nemotron-H's ``mlp`` layers)."""
    ffn: bool = True
    """Whether the layer holds the spec's feed-forward block (its MLP, or its routed experts)."""


ATTENTION_AND_MLP = LayerKind("attention", True)
"""The kind of every layer of a decoder whose layers are all alike."""


@dataclass(frozen=True)
class DeltaNetLayout:
    """A gated DeltaNet mixer's modules (Qwen 3.5, Qwen3-Next), relative to the layer.

    ``num_k_heads`` query/key heads of ``head_k_dim`` and ``num_v_heads`` value heads of ``head_v_dim``; value head
    ``j`` reads query/key head ``j // (num_v_heads / num_k_heads)`` (the kernels' ``repeat_interleave``). The
    short convolution ``conv1d`` runs over ``[all q, all k, all v]`` channels; ``dt_bias`` and ``A_log`` hold one
    value per value head; the gated RMSNorm ``norm`` normalises each value head over ``head_v_dim`` with one weight
    shared by every head; ``out_proj`` reads the value heads."""

    path: str = "linear_attn"
    fused_qkvz: bool = False
    """Qwen3-Next: ``in_proj_qkvz`` rows ``[q_g, k_g, v_g, z_g]`` and ``in_proj_ba`` rows ``[b_g, a_g]`` per key head
    ``g``; else (Qwen 3.5) ``in_proj_qkv`` rows ``[all q, all k, all v]``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``."""
    v_heads_key: str = "linear_num_value_heads"
    k_heads_key: str = "linear_num_key_heads"

    @property
    def readers(self) -> tuple[str, ...]:
        """The projections reading the residual stream, relative to the mixer."""
        return (
            ("in_proj_qkvz", "in_proj_ba")
            if self.fused_qkvz
            else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        )


@dataclass(frozen=True)
class Mamba2Layout:
    """A Mamba-2 mixer's modules (Nemotron-H, Granite 4.0-H), relative to the layer.

    ``in_proj`` rows ``[z (heads x head_dim), x (heads x head_dim), B (groups x state), C (groups x state),
    dt (heads)]``; ``conv1d`` runs over ``[x, B, C]``; ``A_log``, ``D`` and ``dt_bias`` hold one value per head; head
    ``h`` reads SSM group ``h // (heads / groups)``; the gated RMSNorm ``norm`` normalises ``x * silu(z)`` over each
    SSM group's channels; ``out_proj`` reads the heads' channels."""

    path: str
    heads_key: str
    groups_key: str
    head_dim_key: str


@dataclass(frozen=True)
class LayerKinds:
    """A hybrid family's per-layer kinds: the config list and what each of its values builds."""

    config_key: str
    """The config's per-layer list (``layer_types``, ``layers_block_type``)."""
    kinds: tuple[tuple[str, LayerKind], ...]
    """Each value of the list and the layer it builds."""
    deltanet: DeltaNetLayout | None = None
    mamba: Mamba2Layout | None = None
    uncovered_experts: str | None = None
    """The config key of routed experts this family's spec does not cover (Granite 4.0-H's MoE variants hold them
    beside the shared MLP): a config with any is refused in one line."""

    def check_config(self, config: Any) -> None:
        """One line for a config of this family that the data does not describe (routed experts it does not cover)."""
        key = self.uncovered_experts
        count = getattr(config, key, None) if key is not None else None
        if count:
            raise SlimkitError(
                f"{getattr(config, 'model_type', 'this')} with routed experts ({key} {count}) is not compressed by "
                "slimkit yet: its spec covers the dense variant (0 experts)"
            )

    def values(self) -> dict[str, LayerKind]:
        return dict(self.kinds)

    def mixers(self) -> tuple[MixerKind, ...]:
        """The token mixers this family's layers may hold."""
        found = {kind.mixer for _value, kind in self.kinds if kind.mixer is not None}
        return tuple(m for m in ("attention", "gated_deltanet", "mamba2") if m in found)

    def layer_values(self, config: Any) -> list[str]:
        """The config's per-layer list (one line when it is missing)."""
        values = getattr(config, self.config_key, None)
        if not isinstance(values, Sequence) or isinstance(values, str):
            raise SlimkitError(
                f"{getattr(config, 'model_type', 'this')} config has no per-layer list {self.config_key}; "
                "it is needed to know which layers hold which token mixer"
            )
        return [str(value) for value in values]

    def kind_of(self, config: Any, index: int) -> LayerKind:
        """The kind of layer ``index`` (one line for a value this family's data does not know)."""
        value = self.layer_values(config)[index]
        known = self.values()
        if value not in known:
            raise SlimkitError(
                f"{getattr(config, 'model_type', 'this model')} layer {index} is of kind '{value}' "
                f"({self.config_key}), which slimkit does not compress yet; known: {', '.join(known)}"
            )
        return known[value]


def merged_widths(widths: Sequence[Mapping[str, int]]) -> dict[str, int] | None:
    """One config's worth of widths from per-layer ones: each key's value where every layer that has the key agrees
    (the layers of a hybrid report the widths of the kinds they hold), else None."""
    merged: dict[str, int] = {}
    for layer in widths:
        for key, value in layer.items():
            if merged.setdefault(key, value) != value:
                return None
    return merged


__all__ = [
    "ATTENTION_AND_MLP",
    "MIXER_LABELS",
    "DeltaNetLayout",
    "LayerKind",
    "LayerKinds",
    "Mamba2Layout",
    "MixerKind",
    "merged_widths",
]
