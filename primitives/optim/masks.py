"""Hard-concrete (L0) gates and SP3's three levels of structured masks (Hu et al., SP3, §2.2, §3.1–3.2).

Hard-concrete gates (Louizos, Welling & Kingma 2018, §4; as used by CoFi, Xia et al. 2022)
------------------------------------------------------------------------------------------

Every mask entry ``z`` is a gate with a learned location ``log α``, temperature ``β`` and stretch
interval ``(l, r)`` (defaults ``β = 2/3``, ``l = −0.1``, ``r = 1.1``, CoFi's values):

* training-time sample: ``u ~ U(ε, 1−ε)``, ``s = σ((log u − log(1−u) + log α) / β)``,
  ``z = min(1, max(0, s (r − l) + l))`` (:func:`hard_concrete_sample`); gradients reach ``log α``
  through ``s`` (reparameterisation) wherever ``0 < z < 1``;
* keep probability, the expected L0 of the gate: ``P(z ≠ 0) = σ(log α − β log(−l / r))``
  (:func:`keep_probability`, Louizos Eq. 12); ``P(z = 1) = σ(log α − β log((1 − l)/(r − 1)))``;
* eval-time (deterministic) value: ``ẑ = min(1, max(0, σ(log α)(r − l) + l))`` in ``[0, 1]``
  (:func:`hard_concrete_deterministic`, Louizos Eq. 13). CoFi instead keeps the top
  ``round(Σ P(z ≠ 0))`` entries of ``σ(0.8 log α / β)``; SP3 (§3.2) binarises all masks at the end
  by one threshold that meets the target (:func:`~slimkit.primitives.optim.sparsity.binarize`), so
  the plain Louizos value is used here;
* ``E[z]`` has no closed form; :func:`expected_value` integrates ``E[z] = ∫₀¹ P(z > y) dy`` with a
  smooth integrand (Simpson's rule), used to check the sampler.

``log α`` starts at CoFi's ``log(1 − p) − log p`` for a drop rate ``p = 0.5`` (i.e. 0) plus
``N(0, 0.01²)`` noise; with it ``P(z ≠ 0) ≈ 0.83`` and ``ẑ = 0.5``.

SP3's masks (Eqs. 3, 9, 13; §3.2 "Multi-stage Pruning")
-------------------------------------------------------

Three levels, each a family of per-layer gates (:data:`MASK_FIELDS`, :data:`LEVEL_OF`):

* **dimension**: hidden-dimension masks of every block, one on the block's input side and one on
  its output side (``mha_in``, ``mha_out``, ``ffn_in``, ``ffn_out``, each ``(d,)``), the FFN
  intermediate mask ``f`` (``(d_f,)``, the paper's ``z_f``) and the masks inside heads ``q``, ``k``,
  ``v``, ``o`` (the paper's ``z_Q, z_K, z_V, z_O``, Eq. 13; ``(H, d_h)``, ``k`` and ``v`` with one
  row per KV head);
* **head**: ``head`` (``(H,)``, ``z_head``);
* **layer**: ``mha`` and ``ffn`` (scalars, ``z_MHA``, ``z_FFN``).

The hidden masks are named by the block they touch, not by the LayerNorm they surround as in the
paper (Eq. 9 puts ``z_in`` before and ``z_out`` after each block's LayerNorm). The mapping, for
layer ``i`` (paper blocks ``MHA,i`` and ``FFN,i``; ``FFN,0`` is the embeddings):

==============  ========================  =======================================================
here            paper (Eq. 9 / Eq. 30)    what it masks
==============  ========================  =======================================================
``mha_in[i]``   ``z_out`` of ``FFN,i−1``  features that ``W_Q, W_K, W_V`` (and ``W_R``) read
``mha_out[i]``  ``z_in`` of ``MHA,i``     features that ``W_O`` (and ``W_R``) write
``ffn_in[i]``   ``z_out`` of ``MHA,i``    features that ``W_U`` (``fc1``; gate and up) read
``ffn_out[i]``  ``z_in`` of ``FFN,i``     features that ``W_D`` (``fc2``/down) writes
==============  ========================  =======================================================

so every weight matrix of a block is masked by its own block's ``*_in`` and ``*_out`` and the
residual matrix ``W_R`` of a block (Eq. 18) maps its ``*_in`` features to its ``*_out`` features.
``hidden="shared"`` uses one ``(d,)`` gate in all four places (CoFi's single hidden mask, the
masks-only baseline of Table 2); ``hidden="none"`` has no hidden masks. ``hidden="per_group"``
(SP3 on LLMs, Appendix F.1 / Fig. 5) has one ``(d,)`` gate per group of consecutive decoder layers
(``groups``; the layers that share one Group PCA basis), used in all four places of every layer of
the group. ``hidden="per_norm"`` (SP3 on post-norm encoders, BERT; Eq. 9 with the projected model
of :func:`slimkit.primitives.projection.project_post_norm`) has one ``(d,)`` gate ``z_j`` per hidden
norm ``j = 0 .. 2L`` (the embeddings' LayerNorm, then per layer the attention-output and the output
LayerNorm), on the fields ``mha_in[i] = z_{2i}``, ``mha_out[i] = ffn_in[i] = z_{2i+1}``,
``ffn_out[i] = z_{2i+2}``: with the ``norm`` placement every norm's input and output are masked by
the same gate (the projected norm j's coordinates are one basis, so ``z_in`` and ``z_out`` of Eq. 9
around one norm must agree for slicing to be exact), and the residual matrix of block ``i`` maps
``z_j``'s kept coordinates to ``z_{j+1}``'s, as Eq. 30's dense residual count has it.

Applying masks to a Hugging Face model (:func:`apply_masks`) never copies a forward pass: forward
hooks and pre-hooks multiply module inputs and outputs. Two placements of the hidden masks:

* ``"norm"`` (default for post-norm models, i.e. BERT; the paper's Eq. 9): ``*_in`` multiplies the
  *output* of the LayerNorm that produces the block's input (the embeddings' LayerNorm for layer 0,
  the previous block's LayerNorm otherwise), so it masks both the block's Linears and the residual;
  ``*_out`` multiplies the *input* of the block's own LayerNorm (branch plus residual). Deleting the
  masked features then equals masking only in the PCA-projected model, where the LayerNorm's
  centring has moved into ``P_in = Uᵀ R`` (Eq. 8) and the norm is a plain ``x / ||x||`` scaled by a
  constant (the pruned norm's ``√(d/n)`` folds into the next weights); on an untouched LayerNorm
  the mean and variance run over all ``d`` features, zeros included. ``ends`` (default: on for a
  ``per_norm`` mask set) also multiplies the *input* of the first hidden norm by ``mha_in[0]`` and
  the *output* of the last one by ``ffn_out[L−1]``, so that every hidden norm's input and output are
  masked: then masking a projected model equals
  :func:`~slimkit.primitives.projection.slice_post_norm_hidden` with the kept coordinates.
* ``"linear"`` (default for pre-norm models, i.e. llama, OPT; Appendix F / Fig. 5): ``*_in``
  multiplies the inputs of q/k/v (resp. gate/up/fc1), ``*_out`` the outputs of o (resp. down/fc2);
  the residual stream itself is not masked (count it with ``residual="none"``, or only at Group PCA
  boundaries).

* ``"stream"`` (pre-norm models with ``hidden="per_group"`` or ``"shared"``; SP3's LLM setting):
  the group's gate multiplies the residual stream where the group starts (a pre-hook on its first
  layer, after any residual matrix there) and the outputs of every o and down/fc2 in the group, so
  the stream stays zero outside the kept coordinates throughout the group (a group's last down/fc2
  in Eq. 34's form, :mod:`slimkit.primitives.projection.fuse`, writes the next group's stream: the
  next group's gate at its start covers it, so it gets no ``ffn_out`` gate). Slicing those
  coordinates away (:func:`slimkit.primitives.projection.slice_stream`) then gives the same outputs
  (up to the norms' ε). A head tied to the embeddings reads the embedding's coordinates, i.e. the
  first group's: its input (the final norm's output) is multiplied by the first group's gate.

The other masks sit on the Linears in every placement: ``q, k, v`` on the outputs of q/k/v per head
slice; ``head`` and ``o`` on the input of o per head slice (so o's bias is not gated by heads, as in
Eq. 3); ``mha`` on the output of o (bias included: ``z_MHA · MHA(x)``); ``f`` on the input of
down/fc2; ``ffn`` on the output of down/fc2. With a :class:`MaskSet` as source, masks are drawn once
per call of the root model (a forward pre-hook on it): training-mode samples or eval-mode
deterministic values, according to the *mask set's* ``training`` flag.

Masks inside heads (``q, k, v, o``) need one KV head per query head and no RoPE: SP3 does not use
them with RoPE models (Appendix F), and with GQA the query and key dimensions are not paired.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE

Level = Literal["dimension", "head", "layer"]
LEVELS: tuple[Level, ...] = ("dimension", "head", "layer")
HiddenMode = Literal["per_block", "per_group", "per_norm", "shared", "none"]
HIDDEN_MODES: tuple[str, ...] = ("per_block", "per_group", "per_norm", "shared", "none")
Placement = Literal["auto", "norm", "linear", "stream"]
PLACEMENTS: tuple[str, ...] = ("auto", "norm", "linear", "stream")

HIDDEN_FIELDS: tuple[str, ...] = ("mha_in", "mha_out", "ffn_in", "ffn_out")
INTERMEDIATE_FIELDS: tuple[str, ...] = ("q", "k", "v", "o")
MASK_FIELDS: tuple[str, ...] = (*HIDDEN_FIELDS, "f", *INTERMEDIATE_FIELDS, "head", "mha", "ffn")
LEVEL_OF: dict[str, Level] = {
    **dict.fromkeys((*HIDDEN_FIELDS, "f", *INTERMEDIATE_FIELDS), "dimension"),
    "head": "head",
    "mha": "layer",
    "ffn": "layer",
}


# -- hard-concrete gates --------------------------------------------------------------------------


@dataclass(frozen=True)
class HardConcreteConfig:
    """Temperature ``beta`` and stretch interval ``(left, right)`` of a hard-concrete gate."""

    beta: float = 2.0 / 3.0
    left: float = -0.1
    right: float = 1.1
    eps: float = 1e-6
    """``u`` is drawn from ``U(eps, 1 − eps)`` so ``log u`` and ``log(1 − u)`` stay finite."""

    def __post_init__(self) -> None:
        if not (self.beta > 0 and self.left < 0 and self.right > 1 and 0 < self.eps < 0.5):
            raise ValueError(f"need beta > 0, left < 0 < 1 < right and 0 < eps < 0.5, got {self}")


DEFAULT_CONFIG = HardConcreteConfig()


def hard_concrete_sample(
    log_alpha: torch.Tensor, u: torch.Tensor | None = None, config: HardConcreteConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """One reparameterised draw ``z ∈ [0, 1]`` per entry of ``log_alpha`` (Louizos Eqs. 9–10).

    ``u`` are the uniforms (drawn here when omitted); they are clamped to ``[eps, 1 − eps]``.
    """
    if u is None:
        u = torch.rand_like(log_alpha)
    u = u.to(log_alpha.dtype).clamp(config.eps, 1.0 - config.eps)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / config.beta)
    return (s * (config.right - config.left) + config.left).clamp(0.0, 1.0)


def hard_concrete_deterministic(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Eval-time value ``min(1, max(0, σ(log α)(r − l) + l))`` (Louizos Eq. 13), in ``[0, 1]``."""
    return (torch.sigmoid(log_alpha) * (config.right - config.left) + config.left).clamp(0.0, 1.0)


def kept_value(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """CoFi's value of a gate that survives binarisation: ``σ(0.8 log α / β)``, in ``(0, 1)``, never 0.

    Louizos' deterministic value clamps at 0 for ``log α < −β logit(−l/(r−l))``; a gate kept by the
    threshold of :func:`~slimkit.primitives.optim.sparsity.binarize` (a ranking) may lie there when
    the masks overshot the target during training, and a kept unit of value 0 is a removed one.
    """
    return torch.sigmoid(0.8 * log_alpha / config.beta)


def keep_probability(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """``P(z ≠ 0) = σ(log α − β log(−l / r))``: the expected L0 norm of each gate (Louizos Eq. 12)."""
    return torch.sigmoid(log_alpha - config.beta * math.log(-config.left / config.right))


def one_probability(log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """``P(z = 1) = σ(log α − β log((1 − l) / (r − 1)))``: the mass clamped at 1."""
    return torch.sigmoid(log_alpha - config.beta * math.log((1.0 - config.left) / (config.right - 1.0)))


def expected_value(
    log_alpha: torch.Tensor, config: HardConcreteConfig = DEFAULT_CONFIG, points: int = 2049
) -> torch.Tensor:
    """``E[z]`` by Simpson's rule on ``E[z] = ∫₀¹ P(z > y) dy = ∫₀¹ σ(log α − β logit((y − l)/(r − l))) dy``.

    The integrand is smooth on ``[0, 1]`` (its argument stays inside ``(0, 1)``), so a few thousand
    points give float64 accuracy far beyond any sampling test. ``points`` is made odd.
    """
    points = points + 1 - points % 2
    y = torch.linspace(0.0, 1.0, points, dtype=torch.float64, device=log_alpha.device)
    s = (y - config.left) / (config.right - config.left)
    tail = torch.sigmoid(log_alpha.detach().double().unsqueeze(-1) - config.beta * torch.logit(s))
    weights = torch.ones_like(y)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return ((tail * weights).sum(-1) / (3.0 * (points - 1))).to(log_alpha.dtype)


def log_alpha_for_drop(drop: float) -> float:
    """CoFi's initial location for a drop rate ``p``: ``log(1 − p) − log p``."""
    if not 0.0 < drop < 1.0:
        raise ValueError(f"initial drop rate must be in (0, 1), got {drop}")
    return math.log(1.0 - drop) - math.log(drop)


class HardConcrete(nn.Module):
    """A tensor of hard-concrete gates with learned ``log_alpha`` of shape ``shape``.

    ``forward()`` samples in training mode and returns the deterministic values in eval mode.
    ``log_alpha`` is float32 whatever the model's dtype (move the module to the model's device); the
    uniform noise comes from a seeded CPU generator and is moved there, and the hooks cast the values
    to the activations' dtype where they multiply them. Gates never become model parameters.
    """

    def __init__(
        self,
        shape: Sequence[int] | int,
        *,
        config: HardConcreteConfig = DEFAULT_CONFIG,
        init_drop: float = 0.5,
        init_std: float = 0.01,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        self.config = config
        self.generator = generator
        init = torch.randn(shape, generator=generator) * init_std + log_alpha_for_drop(init_drop)
        self.log_alpha = nn.Parameter(init)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.log_alpha.shape)}, beta={self.config.beta:.4g}"

    def sample(self) -> torch.Tensor:
        u = torch.rand(self.log_alpha.shape, generator=self.generator, dtype=torch.float64)
        return hard_concrete_sample(self.log_alpha, u.to(self.log_alpha.device), self.config)

    def deterministic(self) -> torch.Tensor:
        return hard_concrete_deterministic(self.log_alpha, self.config)

    def kept_value(self) -> torch.Tensor:
        return kept_value(self.log_alpha.detach(), self.config)

    def keep_prob(self) -> torch.Tensor:
        return keep_probability(self.log_alpha, self.config)

    def forward(self) -> torch.Tensor:
        return self.sample() if self.training else self.deterministic()


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
        if name in ("q", "o"):
            return (self.heads[layer], self.head_dim)
        if name == "head":
            return (self.heads[layer],)
        if name in ("mha", "ffn"):
            return ()
        raise KeyError(f"unknown mask '{name}'; known: {', '.join(MASK_FIELDS)}")


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


def _check_groups(groups: Sequence[Sequence[int]] | None, num_layers: int) -> tuple[range, ...]:
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

    ``head``/``layer``/``intermediate`` switch the head masks, the layer masks and the masks inside
    heads off entirely (Table 11's variants; Appendix F's LLM setting has none of the three).
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
        self.groups = _check_groups(groups, shape.num_layers) if hidden == "per_group" else None
        if intermediate and shape.rope:
            raise SlimkitError(
                "masks inside heads (q, k, v, o) are not supported for RoPE models (SP3 Appendix F); "
                "set intermediate: false"
            )
        if intermediate and any(h != kv for h, kv in zip(shape.heads, shape.kv_heads, strict=True)):
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
        if head:
            names.append("head")
        if layer:
            names += ["mha", "ffn"]
        self.names = tuple(n for n in MASK_FIELDS if n in names)
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
        return tuple(n for n in MASK_FIELDS if n in self.names or n in HIDDEN_FIELDS)

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


def resolve_placement(
    view: ModelView, placement: Placement = "auto", *, grouped: bool = False
) -> Literal["norm", "linear", "stream"]:
    """``auto``: ``norm`` for post-norm models (BERT); for pre-norm ones (llama, OPT) ``stream`` with
    per-group hidden masks (``grouped``), ``linear`` otherwise."""
    if placement not in PLACEMENTS:
        raise SlimkitError(f"unknown mask placement '{placement}'; allowed: {', '.join(PLACEMENTS)}")
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
    placement: Placement = "auto",
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
    where = resolve_placement(view, placement, grouped=groups is not None)
    if where == "stream":
        groups = _check_groups(groups, view.num_layers)
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
        for role in ("q", "k", "v"):
            post(layer.linear(role), value(role, i), heads if role == "q" else layer.num_kv_heads)
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
