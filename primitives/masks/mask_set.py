"""SP3's three levels of structured masks (Eqs. 3, 9, 13; §3.2 "Multi-stage Pruning").

The mask fields of every layer (dimension, head and layer levels), their shapes, and the set of hard-concrete gates
that samples them (:class:`MaskSet`).

Method note: docs/methods/masks-hard-concrete.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.gates import (
    DEFAULT_CONFIG,
    HardConcrete,
    HardConcreteConfig,
)

Level = Literal["dimension", "head", "layer"]
LEVELS: tuple[Level, ...] = ("dimension", "head", "layer")
HiddenMode = Literal["per_block", "per_group", "per_norm", "shared", "none"]
HIDDEN_MODES: tuple[str, ...] = ("per_block", "per_group", "per_norm", "shared", "none")

HIDDEN_FIELDS: tuple[str, ...] = ("mha_in", "mha_out", "ffn_in", "ffn_out")
INTERMEDIATE_FIELDS: tuple[str, ...] = ("q", "k", "v", "o")
SHARED_INTERMEDIATE_FIELDS: tuple[str, ...] = ("qk", "vo")
"""One gate per head dimension shared by q and k (z_Q = z_K) and one shared by v and o (z_V = z_O): the widths a
runnable head keeps (:mod:`slimkit.primitives.arch.head_widths`)."""
MASK_FIELDS: tuple[str, ...] = (*HIDDEN_FIELDS, "f", *INTERMEDIATE_FIELDS, "head", "mha", "ffn")
"""The fields of a mask set with every default level on (the shared intermediate masks are asked for apart)."""
ALL_MASK_FIELDS: tuple[str, ...] = (*MASK_FIELDS, *SHARED_INTERMEDIATE_FIELDS)
LEVEL_OF: dict[str, Level] = {
    **dict.fromkeys((*HIDDEN_FIELDS, "f", *INTERMEDIATE_FIELDS, *SHARED_INTERMEDIATE_FIELDS), "dimension"),
    "head": "head",
    "mha": "layer",
    "ffn": "layer",
}


# -- shapes and values ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskShape:
    """The widths the masks (and the sparsity count) need, per layer.

    ``bias`` names the Linear roles that carry a bias (``q k v o up gate down``), used only when a
    count includes biases.
    """

    hidden: int
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    head_dim: int
    ffn: tuple[int, ...]
    gated: bool = False
    bias: frozenset[str] = frozenset()
    rope: bool = False

    def __post_init__(self) -> None:
        n = len(self.heads)
        if not (len(self.kv_heads) == len(self.ffn) == n):
            raise ValueError("heads, kv_heads and ffn need one entry per layer")
        for h, kv in zip(self.heads, self.kv_heads, strict=True):
            if kv <= 0 or h % kv:
                raise ValueError(f"{h} query heads cannot be grouped over {kv} KV heads")

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    @classmethod
    def from_view(cls, view: ModelView) -> MaskShape:
        layers = view.layers
        first = layers[0]
        bias = frozenset(r for r in first.roles if getattr(first.linear(r), "bias", None) is not None)
        return cls(
            hidden=view.hidden_size,
            heads=tuple(layer.num_heads for layer in layers),
            kv_heads=tuple(layer.num_kv_heads for layer in layers),
            head_dim=first.head_dim,
            ffn=tuple(layer.mlp_width for layer in layers),
            gated=first.mlp_kind == "gated",
            bias=bias,
            rope=first.rope,
        )

    def field_shape(self, name: str, layer: int) -> tuple[int, ...]:
        """The shape of mask ``name`` in ``layer``."""
        if name in HIDDEN_FIELDS:
            return (self.hidden,)
        if name == "f":
            return (self.ffn[layer],)
        if name in ("k", "v"):
            return (self.kv_heads[layer], self.head_dim)
        if name in ("q", "o", "qk", "vo"):
            return (self.heads[layer], self.head_dim)
        if name == "head":
            return (self.heads[layer],)
        if name in ("mha", "ffn"):
            return ()
        raise KeyError(f"unknown mask '{name}'; known: {', '.join(ALL_MASK_FIELDS)}")


@dataclass
class MaskValues:
    """One value per mask entry (keep probabilities, samples, deterministic values, scores or 0/1).

    Every field is ``None`` (the mask is absent or inactive: all ones) or a list with one tensor per
    layer shaped as :meth:`MaskShape.field_shape` says.
    """

    mha_in: list[torch.Tensor] | None = None
    mha_out: list[torch.Tensor] | None = None
    ffn_in: list[torch.Tensor] | None = None
    ffn_out: list[torch.Tensor] | None = None
    f: list[torch.Tensor] | None = None
    q: list[torch.Tensor] | None = None
    k: list[torch.Tensor] | None = None
    v: list[torch.Tensor] | None = None
    o: list[torch.Tensor] | None = None
    qk: list[torch.Tensor] | None = None
    vo: list[torch.Tensor] | None = None
    head: list[torch.Tensor] | None = None
    mha: list[torch.Tensor] | None = None
    ffn: list[torch.Tensor] | None = None

    def present(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)

    def items(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        for name in self.present():
            yield name, getattr(self, name)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MaskValues:
        """A copy with ``fn`` applied to every tensor (``None`` fields stay ``None``)."""
        return replace(self, **{name: [fn(t) for t in values] for name, values in self.items()})

    def only(self, levels: Sequence[str]) -> MaskValues:
        """A copy keeping only the masks of ``levels`` (the rest become ``None``)."""
        return replace(self, **{name: None for name in self.present() if LEVEL_OF[name] not in levels})

    def times(self, other: MaskValues) -> MaskValues:
        """Entry-wise product (a ``None`` field counts as ones), e.g. deterministic values times 0/1 masks."""
        out = {}
        for f in fields(self):
            x, y = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = y if x is None else x if y is None else [a * b for a, b in zip(x, y, strict=True)]
        return MaskValues(**out)

    def check(self, shape: MaskShape) -> None:
        for name, values in self.items():
            if len(values) != shape.num_layers:
                raise ValueError(f"mask '{name}' has {len(values)} layers, the model {shape.num_layers}")
            for i, t in enumerate(values):
                if tuple(t.shape) != shape.field_shape(name, i):
                    raise ValueError(
                        f"mask '{name}' layer {i} has shape {tuple(t.shape)}, expected {shape.field_shape(name, i)}"
                    )

    @classmethod
    def ones(cls, shape: MaskShape, names: Sequence[str] = MASK_FIELDS) -> MaskValues:
        """All-ones masks for ``names`` (float32)."""
        return cls(**{n: [torch.ones(shape.field_shape(n, i)) for i in range(shape.num_layers)] for n in names})


# -- the mask set -----------------------------------------------------------------------------------


def check_layer_groups(groups: Sequence[Sequence[int]] | None, num_layers: int) -> tuple[range, ...]:
    """Consecutive, non-empty groups covering layers ``0 .. num_layers - 1`` in order."""
    if groups is None:
        raise SlimkitError("hidden: per_group needs the layer groups (e.g. the Group PCA groups)")
    out, start = [], 0
    for group in groups:
        layers = list(group)
        if not layers or layers != list(range(start, start + len(layers))):
            raise SlimkitError(f"layer groups must be consecutive and cover layers 0..{num_layers - 1}; got {groups}")
        out.append(range(start, start + len(layers)))
        start += len(layers)
    if start != num_layers:
        raise SlimkitError(f"layer groups cover {start} layers, the model has {num_layers}")
    return tuple(out)


class MaskSet(nn.Module):
    """All of SP3's gates for one model (:data:`MASK_FIELDS`), grouped in levels.

    ``head``/``layer``/``intermediate`` switch the head masks, the layer masks and the four masks inside
    heads (q, k, v, o) off entirely (Table 11's variants; Appendix F's LLM setting has none of the three);
    ``shared_intermediate`` adds the two shared masks inside heads (``qk``: z_Q = z_K, ``vo``: z_V = z_O: SP3's
    MHA-intermediate masks as a runnable head keeps them, one q/k and one v/o width per head).
    ``hidden`` picks per-block hidden masks (SP3), one shared hidden mask (CoFi) or none. Only the
    masks of :attr:`active` levels are applied, counted and trained (:meth:`set_active`); the rest
    act as ones. ``forward()`` returns :class:`MaskValues`: samples in training mode, deterministic
    values in eval mode.
    """

    def __init__(
        self,
        shape: MaskShape,
        *,
        head: bool = True,
        layer: bool = True,
        intermediate: bool = True,
        shared_intermediate: bool = False,
        hidden: HiddenMode = "per_block",
        groups: Sequence[Sequence[int]] | None = None,
        config: HardConcreteConfig = DEFAULT_CONFIG,
        init_drop: float = 0.5,
        init_std: float = 0.01,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if hidden not in HIDDEN_MODES:
            raise SlimkitError(f"unknown hidden mask mode '{hidden}'; allowed: {', '.join(HIDDEN_MODES)}")
        self.groups = check_layer_groups(groups, shape.num_layers) if hidden == "per_group" else None
        inside = intermediate or shared_intermediate
        if inside and shape.rope:
            raise SlimkitError(
                "masks inside heads (q, k, v, o) are not supported for RoPE models (SP3 Appendix F); "
                "set intermediate: false"
            )
        if inside and any(h != kv for h, kv in zip(shape.heads, shape.kv_heads, strict=True)):
            raise SlimkitError(
                "masks inside heads (q, k, v, o) need one KV head per query head; set intermediate: false"
            )
        self.shape = shape
        self.config = config
        self.hidden_mode = hidden
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        kw = {"config": config, "init_drop": init_drop, "init_std": init_std, "generator": self.generator}
        names = ["f"]
        if hidden == "per_block":
            names += list(HIDDEN_FIELDS)
        if intermediate:
            names += list(INTERMEDIATE_FIELDS)
        if shared_intermediate:
            names += list(SHARED_INTERMEDIATE_FIELDS)
        if head:
            names.append("head")
        if layer:
            names += ["mha", "ffn"]
        self.names = tuple(n for n in ALL_MASK_FIELDS if n in names)
        self.gates = nn.ModuleDict(
            {
                n: nn.ModuleList(HardConcrete(shape.field_shape(n, i), **kw) for i in range(shape.num_layers))
                for n in self.names
            }
        )
        self.shared_hidden = HardConcrete((shape.hidden,), **kw) if hidden == "shared" else None
        self.group_hidden = (
            nn.ModuleList(HardConcrete((shape.hidden,), **kw) for _ in self.groups) if self.groups is not None else None
        )
        self.norm_hidden = (
            nn.ModuleList(HardConcrete((shape.hidden,), **kw) for _ in range(2 * shape.num_layers + 1))
            if hidden == "per_norm"
            else None
        )
        self.active: frozenset[str] = frozenset()
        self.set_active(LEVELS)

    @classmethod
    def from_view(cls, view: ModelView, **kwargs) -> MaskSet:
        return cls(MaskShape.from_view(view), **kwargs)

    @property
    def levels(self) -> frozenset[str]:
        """The levels this set has gates for."""
        return frozenset(LEVEL_OF[n] for n in self.field_names())

    def field_names(self) -> tuple[str, ...]:
        """Mask fields present (a shared or per-group hidden mask stands for all four hidden fields)."""
        if self.shared_hidden is None and self.group_hidden is None and self.norm_hidden is None:
            return self.names
        return tuple(n for n in ALL_MASK_FIELDS if n in self.names or n in HIDDEN_FIELDS)

    def set_active(self, levels: Sequence[str]) -> None:
        """Apply, count and train only the masks of ``levels``; the others act as ones and are frozen."""
        unknown = set(levels) - set(LEVELS)
        if unknown:
            raise SlimkitError(f"unknown mask level(s) {sorted(unknown)}; allowed: {', '.join(LEVELS)}")
        self.active = frozenset(levels)
        for gate, level in self._gates():
            gate.log_alpha.requires_grad_(level in self.active)

    def _gates(self) -> Iterator[tuple[HardConcrete, Level]]:
        for name in self.names:
            for gate in self.gates[name]:
                yield gate, LEVEL_OF[name]
        if self.shared_hidden is not None:
            yield self.shared_hidden, "dimension"
        for gate in self.group_hidden or ():
            yield gate, "dimension"
        for gate in self.norm_hidden or ():
            yield gate, "dimension"

    def level_parameters(self, level: Level) -> list[nn.Parameter]:
        """The ``log_alpha`` parameters of one level (for a per-level optimiser or learning rate)."""
        return [gate.log_alpha for gate, lv in self._gates() if lv == level]

    def _collect(self, fn: Callable[[HardConcrete], torch.Tensor]) -> MaskValues:
        out: dict[str, list[torch.Tensor]] = {}
        for name in self.names:
            if LEVEL_OF[name] in self.active:
                out[name] = [fn(gate) for gate in self.gates[name]]
        if self.shared_hidden is not None and "dimension" in self.active:
            value = fn(self.shared_hidden)
            for name in HIDDEN_FIELDS:
                out[name] = [value] * self.shape.num_layers
        if self.group_hidden is not None and "dimension" in self.active:
            per_group = [fn(gate) for gate in self.group_hidden]
            per_layer = [per_group[g] for g, layers in enumerate(self.groups) for _ in layers]
            for name in HIDDEN_FIELDS:
                out[name] = list(per_layer)
        if self.norm_hidden is not None and "dimension" in self.active:
            z = [fn(gate) for gate in self.norm_hidden]
            n = self.shape.num_layers
            out["mha_in"] = [z[2 * i] for i in range(n)]
            out["mha_out"] = [z[2 * i + 1] for i in range(n)]
            out["ffn_in"] = [z[2 * i + 1] for i in range(n)]
            out["ffn_out"] = [z[2 * i + 2] for i in range(n)]
        return MaskValues(**out)

    def sample(self) -> MaskValues:
        return self._collect(HardConcrete.sample)

    def deterministic(self) -> MaskValues:
        return self._collect(HardConcrete.deterministic)

    def kept_values(self) -> MaskValues:
        """Each active gate's value if binarisation keeps it (:func:`kept_value`, CoFi's rule)."""
        return self._collect(HardConcrete.kept_value)

    def keep_probs(self) -> MaskValues:
        """``P(z ≠ 0)`` of every active gate: the input of the expected-sparsity count (Eq. 30)."""
        return self._collect(HardConcrete.keep_prob)

    def scores(self) -> MaskValues:
        """``log α`` of every active gate (detached): the ranking used to binarise (no ties at the clamps)."""
        return self._collect(lambda gate: gate.log_alpha.detach().clone())

    def forward(self) -> MaskValues:
        return self.sample() if self.training else self.deterministic()


def apply_rank_prior(masks: MaskSet, spread: float) -> None:
    """Tilt the start of every hidden gate on a PCA-ordered stream by its coordinate's rank, in place.

    Coordinate ``k`` of a ``d``-wide gate (a decoder's per-group gate, an encoder's per-norm gate: both
    streams are in decreasing order of explained variance after the projection) moves by
    ``spread · (1/2 − k/(d − 1))``: the first component gains ``spread/2``, the last loses as much, the mean
    ``log α`` is unchanged. CoFi's start draws the same noise on every coordinate, and in a PCA basis a
    dropped leading component costs far more than a dropped trailing one. A shared (CoFi) hidden gate is on
    raw dimensions and is left alone.
    """
    for gate in [*(masks.group_hidden or ()), *(masks.norm_hidden or ())]:
        d = gate.log_alpha.numel()
        ranks = torch.arange(d, dtype=gate.log_alpha.dtype, device=gate.log_alpha.device)
        with torch.no_grad():
            gate.log_alpha.add_(spread * (0.5 - ranks / max(d - 1, 1)))
