"""`ModelView`: an architecture-neutral view of a loaded Hugging Face model.

The view resolves modules by attribute path on every access, so surgery that replaces a module
(for example a pruned or low-rank Linear) is seen at once. Widths (heads, KV heads, MLP width)
are read from the modules' shapes, never from the config, because after pruning they differ per
layer while the config still holds the dense values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

from torch import nn

from slimkit.primitives.arch.fused import is_split
from slimkit.primitives.arch.head_widths import HeadWidthAttention, HeadWidths
from slimkit.primitives.arch.latent_attention import config_entries, latent_widths, sync_latent_attention
from slimkit.primitives.arch.layer_config import with_own_values
from slimkit.primitives.arch.layer_kinds import ATTENTION_AND_MLP, LayerKind
from slimkit.primitives.arch.mixers import DeltaNetView, Mamba2View, MixerView
from slimkit.primitives.arch.moe import fill_mixed_widths, layer_moe_widths, mixed_layer_widths
from slimkit.primitives.arch.removed import BLOCK_KINDS, BlockKind, RemovedAttention, RemovedMLP
from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.primitives.arch.support import unsupported_message
from slimkit.primitives.errors import SlimkitError

LinearRole = Literal["q", "k", "v", "o", "up", "gate", "down"]
LINEAR_ROLES: tuple[LinearRole, ...] = ("q", "k", "v", "o", "up", "gate", "down")
BLOCK_ROLES: dict[BlockKind, tuple[LinearRole, ...]] = {
    "attention": ("q", "k", "v", "o"),
    "mlp": ("gate", "up", "down"),
}
"""The projections each sub-block holds (gone when the block is removed)."""

# Attributes that attention implementations read at run time, and how each follows from the
# per-layer head counts. An attention module gets whichever of these it already has.
_HEAD_ATTRS = {
    "num_heads": lambda h, kv, d: h,
    "num_attention_heads": lambda h, kv, d: h,
    "num_key_value_heads": lambda h, kv, d: kv,
    "num_key_value_groups": lambda h, kv, d: h // kv,
    "all_head_size": lambda h, kv, d: h * d,
}


def _get(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path)


def out_features(module: nn.Module) -> int:
    return int(module.out_features)


@dataclass
class NormView:
    module: nn.Module
    kind: str
    placement: str


class LayerView:
    """One decoder/encoder layer: its attention, MLP and norms, with widths read from shapes.

    ``kind``: what the layer holds (a hybrid's layers differ: :mod:`slimkit.primitives.arch.layer_kinds`); a layer
    without softmax attention has no q/k/v/o roles and no heads, one without the feed-forward block no MLP roles.
    ``config``: the model's config (MoE families with dense layers among routed ones, latent attention)."""

    def __init__(
        self, index: int, module: nn.Module, spec: ArchSpec, config: Any = None, kind: LayerKind = ATTENTION_AND_MLP
    ) -> None:
        self.index = index
        self.module = module
        self.spec = spec
        self.config = config
        self.kind = kind

    # -- modules -------------------------------------------------------------------------------
    @property
    def routed(self) -> bool:
        """Whether this layer's MLP is routed experts (a MoE family's layer that routes and was not removed)."""
        if self.spec.experts is None:
            return False
        try:
            self.module.get_submodule(self.spec.experts)
        except AttributeError:
            return False
        return True

    def linear(self, role: LinearRole) -> nn.Module:
        path = getattr(self.spec, role)
        if path is None:
            raise KeyError(f"{self.spec.model_type} layers have no '{role}' projection")
        return _get(self.module, self.linear_path(role))

    def set_linear(self, role: LinearRole, module: nn.Module) -> None:
        self.module.set_submodule(self.linear_path(role), module)

    def linear_path(self, role: LinearRole) -> str:
        path = getattr(self.spec, role)
        if self.spec.shared_mlp is not None and role in BLOCK_ROLES["mlp"] and self.routed:
            return f"{self.spec.shared_mlp}.{path.rpartition('.')[2]}"  # the shared expert's projection
        return path

    @property
    def roles(self) -> tuple[LinearRole, ...]:
        """The projections the layer has (those of a removed sub-block are gone)."""
        gone = {role for kind in self.removed_blocks for role in BLOCK_ROLES[kind]}
        if self.kind.mixer != "attention":
            gone |= set(BLOCK_ROLES["attention"])
        if not self.kind.ffn:
            gone |= set(BLOCK_ROLES["mlp"])
        if self.spec.experts is not None and (self.spec.shared_mlp is None or not self.routed) and not self._dense():
            gone |= set(BLOCK_ROLES["mlp"])  # a MoE MLP: fused expert tensors, no projection modules
        return tuple(r for r in LINEAR_ROLES if getattr(self.spec, r) is not None and r not in gone)

    def _dense(self) -> bool:
        """A MoE family's layer built with a dense MLP (DeepSeek-V3's first layers), still present."""
        if self.spec.experts is None or self.routed or self.mlp_removed:
            return False
        try:
            self.module.get_submodule(self.spec.up)
        except AttributeError:
            return False
        return True

    def extra_linears(self) -> list[nn.Module]:
        """The layer's projections beyond its roles (:attr:`ArchSpec.extra_linears`), where present."""
        if self.attention_removed:
            return []
        return [_get(self.module, path) for path in self.spec.extra_linears]

    # -- removed sub-blocks (primitives/arch/removed.py) --------------------------------------
    @property
    def attention_removed(self) -> bool:
        return self.kind.mixer == "attention" and isinstance(self.attention, RemovedAttention)

    @property
    def mlp_removed(self) -> bool:
        return self.kind.ffn and self.spec.mlp is not None and isinstance(_get(self.module, self.spec.mlp), RemovedMLP)

    @property
    def has_attention(self) -> bool:
        """Whether the layer holds softmax attention now (its kind has it and the block was not removed)."""
        return self.kind.mixer == "attention" and not self.attention_removed

    @property
    def has_mlp(self) -> bool:
        """Whether the layer holds the feed-forward block now."""
        return self.kind.ffn and not self.mlp_removed

    @property
    def mixer(self) -> MixerView | None:
        """The layer's token mixer other than softmax attention (gated DeltaNet, Mamba-2), or None."""
        kinds = self.spec.layer_kinds
        if kinds is None or self.kind.mixer in (None, "attention"):
            return None
        if self.kind.mixer == "gated_deltanet" and kinds.deltanet is not None:
            return DeltaNetView(_get(self.module, kinds.deltanet.path), kinds.deltanet)
        if self.kind.mixer == "mamba2" and kinds.mamba is not None:
            return Mamba2View(_get(self.module, kinds.mamba.path), kinds.mamba)
        raise SlimkitError(f"{self.spec.model_type} names no module layout for its {self.kind.mixer} layers")

    @property
    def removed_blocks(self) -> tuple[BlockKind, ...]:
        """The sub-blocks of this layer that were removed (``attention``, ``mlp``)."""
        flags = {"attention": self.attention_removed, "mlp": self.mlp_removed}
        return tuple(kind for kind in BLOCK_KINDS if flags[kind])

    @property
    def attention(self) -> nn.Module:
        return _get(self.module, self.spec.attention)

    def _input_norm(self, path: str | None, which: str) -> NormView:
        if path is None:
            raise SlimkitError(
                f"{self.spec.model_type} layers have no {which} input norm (their norms follow the branches)"
            )
        return NormView(_get(self.module, path), self.spec.norm_kind, self.spec.norm_placement)

    @property
    def attn_norm(self) -> NormView:
        return self._input_norm(self.spec.attn_norm, "attention")

    @property
    def mlp_norm(self) -> NormView:
        return self._input_norm(self.spec.mlp_norm, "MLP")

    @property
    def norms(self) -> list[nn.Module]:
        """Every norm of the layer on the residual stream's width (input norms and branch post-norms; a removed
        block's norms are ``nn.Identity`` stand-ins without parameters)."""
        return [_get(self.module, path) for path in dict.fromkeys(self.spec.layer_norms)]

    @property
    def q_norm(self) -> nn.Module | None:
        """The per-head query norm over ``head_dim`` (Qwen3), or None (also once the attention block was removed,
        in a layer without softmax attention, and in a layer built without one: GLM-4.5's optional norms, Llama 4's
        layers without RoPE)."""
        return self._optional(self.spec.q_norm)

    @property
    def k_norm(self) -> nn.Module | None:
        """The per-head key norm over ``head_dim`` (Qwen3), or None (as :attr:`q_norm`)."""
        return self._optional(self.spec.k_norm)

    def _optional(self, path: str | None) -> nn.Module | None:
        if path is None or not self.has_attention:
            return None
        try:
            return _get(self.module, path)
        except AttributeError:
            return None

    @property
    def mlp_kind(self) -> str:
        return self.spec.mlp_kind

    @property
    def mlp_input_roles(self) -> tuple[LinearRole, ...]:
        """The projections that read the residual stream into the MLP (up, and gate if gated)."""
        return ("gate", "up") if self.spec.gate is not None else ("up",)

    # -- widths --------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """The attention's head width (0 in a layer whose kind holds no softmax attention)."""
        if self.kind.mixer != "attention":
            return 0
        if self.attention_removed:  # the stand-in keeps the head width the layer had
            return int(self.attention.head_dim)
        return int(getattr(self.attention, self.spec.head_dim_attr))

    @property
    def head_widths(self) -> HeadWidths | None:
        """Each head's kept q/k and v/o widths when the heads differ (SP3's MHA-intermediate masks), else None."""
        attn = self.attention if self.has_attention else None
        return attn.widths if isinstance(attn, HeadWidthAttention) else None

    @property
    def num_heads(self) -> int:
        """Query heads (0 when the attention block was removed or the layer holds none)."""
        if not self.has_attention:
            return 0
        widths = self.head_widths
        if widths is not None:
            return widths.num_heads
        return out_features(self.linear("q")) // (self.head_dim * self.spec.q_rows_per_head)

    @property
    def num_kv_heads(self) -> int:
        if not self.has_attention:
            return 0
        if self.spec.latent_attention is not None:  # MLA expands the latent into a key and value per head
            return self.num_heads
        widths = self.head_widths
        return widths.num_heads if widths is not None else out_features(self.linear("k")) // self.head_dim

    @property
    def mlp_width(self) -> int:
        """MLP channels (0 when the MLP block was removed or the layer holds none; one routed expert's width in a MoE
        layer)."""
        if not self.has_mlp:
            return 0
        if self.routed:
            return layer_moe_widths(self.module, self.spec.model_type)[self._moe_width_key()]  # type: ignore[index]
        return out_features(self.linear("up"))

    def _moe_width_key(self) -> str:
        from slimkit.primitives.arch.moe import MOE_SPECS

        return MOE_SPECS[self.spec.model_type].width_key

    @property
    def rope(self) -> bool:
        return self.spec.rope

    def widths(self) -> dict[str, int]:
        """The config entries of this layer's widths. A hybrid's layer gives those of the kinds it holds (its
        attention's heads or its mixer's, its MLP width where it has the feed-forward block); a MoE family with
        dense layers among routed ones, or latent attention, its layer's own entries."""
        if self.spec.layer_kinds is not None:
            return self._kind_widths()
        latent = self.spec.latent_attention
        mixed = mixed_layer_widths(self.module, self.index, self.spec.model_type, self.config)
        if latent is not None or mixed is not None:
            if latent is None:
                attention = {
                    "num_attention_heads": self.num_heads,
                    "num_key_value_heads": self.num_kv_heads,
                    "head_dim": self.head_dim,
                }
            elif self.attention_removed:
                rope = int(getattr(self.config, "head_dim", None) or self.head_dim)  # MLA's config head_dim: rotary
                attention = {"num_attention_heads": 0, "num_key_value_heads": 0, "head_dim": rope}
                attention |= {latent.q_rank_key: 0, latent.kv_rank_key: 0}
            else:
                attention = config_entries(latent_widths(self.attention, latent), latent)
            mlp = mixed if mixed is not None else {self.spec.intermediate_size_key: self.mlp_width}
            first = {k: attention.pop(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
            return {**first, **mlp, **attention}  # the layer's own MLP width first (the report reads it there)
        moe = layer_moe_widths(self.module, self.spec.model_type)
        return {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            self.spec.intermediate_size_key: self.mlp_width,
            **(moe or {}),
        }

    def _kind_widths(self) -> dict[str, int]:
        widths: dict[str, int] = {}
        if self.kind.mixer == "attention":
            widths |= {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads}
            widths["head_dim"] = self.head_dim
        mixer = self.mixer
        if mixer is not None:
            widths |= mixer.widths()
        if self.kind.ffn:
            widths |= layer_moe_widths(self.module, self.spec.model_type) or {}
            widths[self.spec.intermediate_size_key] = self.mlp_width
        return widths

    def sync_head_counts(self) -> None:
        """Update the attention module's run-time head attributes from its projection shapes (a
        :class:`HeadWidthAttention` keeps its own widths: they are checked against the shapes instead), and a
        hybrid layer's mixer's (:meth:`MixerView.sync`)."""
        mixer = self.mixer
        if mixer is not None:
            mixer.sync()
        if not self.has_attention:
            return
        if isinstance(self.attention, HeadWidthAttention):
            self.attention.check()
            return
        if self.spec.latent_attention is not None:
            sync_latent_attention(self.attention, self.spec.latent_attention)
            return
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if kv == 0 or h % kv:
            raise ValueError(f"layer {self.index}: {h} query heads cannot be grouped over {kv} KV heads")
        attn = self.attention
        for attr, rule in _HEAD_ATTRS.items():
            if hasattr(attn, attr):
                setattr(attn, attr, rule(h, kv, d))
        if self.spec.head_config_keys:  # the forward reads these from its config: one config per attention module
            own = {key: _HEAD_ATTRS[key](h, kv, d) for key in self.spec.head_config_keys}
            setattr(attn, "config", with_own_values(attn.config, own))  # noqa: B010 (not a tensor or module)

    def set_head_dim(self, head_dim: int) -> None:
        """Give the attention module the head width ``head_dim`` and the scale its constructor derives from it
        (``scaling = head_dim ** -0.5``), for an architecture whose constructor derives both from the config
        (``ArchSpec.head_dim_from_hidden``); the head counts then follow from the shapes (:meth:`sync_head_counts`).
        A removed attention or a :class:`HeadWidthAttention` (it keeps its own widths) is left as it is."""
        if not self.spec.head_dim_from_hidden:
            raise SlimkitError(f"{self.spec.model_type} attentions take their head width from the config, not here")
        if not self.has_attention or isinstance(self.attention, HeadWidthAttention):
            return
        attn = self.attention
        setattr(attn, self.spec.head_dim_attr, head_dim)
        if hasattr(attn, "scaling"):
            attn.scaling = head_dim**-0.5

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


class ModelView:
    """Architecture-neutral access to a Hugging Face model (causal LM, encoder or task model)."""

    def __init__(self, model: nn.Module) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in ARCH_SPECS:
            raise SlimkitError(unsupported_message(model_type))
        self.model = model
        self.spec = ARCH_SPECS[model_type]
        self.config = model.config
        latent = self.spec.latent_attention
        if latent is not None and getattr(self.config, latent.q_rank_key, 0) is None:
            raise SlimkitError(
                f"{model_type}: an attention without a query latent ({latent.q_rank_key} null, one plain q_proj: "
                "DeepSeek-V2-Lite's layout) is not supported; allowed: a q_a_proj / q_b_proj pair"
            )
        if self.spec.fused and not is_split(model):
            fused = ", ".join(f.path for f in self.spec.fused)
            raise SlimkitError(
                f"this {model_type} model holds fused projections ({fused}) as single matrices; slimkit sees them "
                "as their parts: load it with slimkit.load, or call slimkit.primitives.arch.fused.split_fused(model)"
            )
        if self.spec.layer_kinds is not None:
            self.spec.layer_kinds.check_config(self.config)
            for index in range(self.num_layers):  # every layer of a kind slimkit knows, refused in one line
                self.layer_kind(index)

    @property
    def base(self) -> nn.Module:
        return self.model.base_model

    @property
    def layer_list(self) -> nn.ModuleList:
        return cast(nn.ModuleList, _get(self.base, self.spec.layers))

    @property
    def layers(self) -> list[LayerView]:
        return [LayerView(i, m, self.spec, self.config, self.layer_kind(i)) for i, m in enumerate(self.layer_list)]

    def layer(self, index: int) -> LayerView:
        return LayerView(index, self.layer_list[index], self.spec, self.config, self.layer_kind(index))

    def layer_kind(self, index: int) -> LayerKind:
        """What layer ``index`` holds (every layer the same outside hybrids)."""
        kinds = self.spec.layer_kinds
        return ATTENTION_AND_MLP if kinds is None else kinds.kind_of(self.config, index)

    @property
    def num_layers(self) -> int:
        return len(self.layer_list)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return cast(nn.Embedding, _get(self.base, self.spec.embed))

    @property
    def final_norm(self) -> NormView | None:
        if self.spec.final_norm is None:
            return None
        return NormView(_get(self.base, self.spec.final_norm), self.spec.norm_kind, self.spec.norm_placement)

    @property
    def head(self) -> nn.Module | None:
        if self.spec.head is None or not hasattr(self.model, self.spec.head):
            return None
        return _get(self.model, self.spec.head)

    @property
    def tied(self) -> bool:
        head = self.head
        return head is not None and head.weight is self.embed_tokens.weight

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.weight.shape[1])

    @property
    def activation(self) -> str:
        return str(getattr(self.config, self.spec.activation_attr))

    def linears(self, layers: Iterable[LayerView] | None = None) -> dict[str, nn.Module]:
        """The projections of ``layers`` (default: every layer) by their paths in the model (one walk)."""
        paths = {id(module): name for name, module in self.model.named_modules()}
        chosen = self.layers if layers is None else list(layers)
        found = {paths[id(layer.linear(role))]: layer.linear(role) for layer in chosen for role in layer.roles}
        found |= {paths[id(module)]: module for layer in chosen for module in layer.extra_linears()}
        for layer in chosen:  # a hybrid layer's mixer projections (gated DeltaNet, Mamba-2)
            mixer = layer.mixer
            found |= {paths[id(module)]: module for module in (mixer.linears().values() if mixer else ())}
        return found

    def path_of(self, module: nn.Module) -> str:
        """The module's path inside the model (``model.get_submodule(path) is module``)."""
        for name, candidate in self.model.named_modules():
            if candidate is module:
                return name
        raise KeyError(f"{type(module).__name__} is not part of this model")

    def layer_widths(self) -> list[dict[str, int]]:
        widths = [layer.widths() for layer in self.layers]
        return fill_mixed_widths(widths, self.spec.model_type, self.config)  # layers of a mixed MoE family

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
