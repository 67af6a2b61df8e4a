"""SP3's expected sparsity (Appendix C, Eq. 30), the Lagrangian pruning loss (Eq. 14) and final binarisation.

The expected parameter count of a masked model, the Lagrangian term that pulls it toward the target, and the one
threshold that binarises every mask to meet it.

Method note: docs/methods/masks-sparsity-lagrangian.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.mask_set import MaskShape, MaskValues

Residual = Literal["dense", "diagonal", "none"]
RESIDUALS: tuple[str, ...] = ("dense", "diagonal", "none")
Number = torch.Tensor | float


def _layer(values: list[torch.Tensor] | None, i: int) -> torch.Tensor | None:
    return None if values is None else values[i].double()


def _total(z: torch.Tensor | None, full: int) -> Number:
    return float(full) if z is None else z.sum()


def _residual(a: torch.Tensor | None, c: torch.Tensor | None, d: int, residual: Residual) -> Number:
    if residual == "none" or (a is None and c is None):
        return 0.0
    if residual == "dense":
        return _total(a, d) * _total(c, d)
    return _diag(a, c)


def _diag(a: torch.Tensor | None, c: torch.Tensor | None) -> Number:
    if a is None:
        return c.sum()
    if c is None:
        return a.sum()
    return (a * c).sum()


def _head_dims(heads: torch.Tensor | None, dims: torch.Tensor | None, n_heads: int, head_dim: int) -> Number:
    """``Σ_j z_head_j Σ_l z[j, l]``: kept rows of one projection."""
    if dims is None:
        return float(n_heads * head_dim) if heads is None else heads.sum() * head_dim
    per_head = dims.sum(-1)
    return per_head.sum() if heads is None else (heads * per_head).sum()


def _both(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
    """The product of two masks on the same entries (``None``: all ones)."""
    return y if x is None else x if y is None else x * y


def _kv_heads(heads: torch.Tensor | None, n_heads: int, n_kv: int) -> torch.Tensor | None:
    """Keep value of each KV head: ``1 − Π (1 − z_head)`` over its query heads (itself without GQA)."""
    if heads is None or n_kv == n_heads:
        return heads
    return 1.0 - (1.0 - heads.view(n_kv, n_heads // n_kv)).prod(-1)


def _check(residual: str, shape: MaskShape, residual_blocks: Sequence[bool] | None) -> None:
    if residual not in RESIDUALS:
        raise SlimkitError(f"unknown residual count '{residual}'; allowed: {', '.join(RESIDUALS)}")
    if residual_blocks is not None and len(residual_blocks) != 2 * shape.num_layers:
        raise ValueError(f"residual_blocks needs {2 * shape.num_layers} entries (mha_0, ffn_0, ...)")


def expected_size(
    values: MaskValues,
    shape: MaskShape,
    *,
    residual: Residual = "dense",
    residual_blocks: Sequence[bool] | None = None,
    include_bias: bool = False,
) -> torch.Tensor:
    """The sum of Eq. 30 (see the module docstring): expected weights left, or the pruned count for 0/1 masks.

    Differentiable in the mask values; computed in float64.
    """
    _check(residual, shape, residual_blocks)
    values.check(shape)
    d, dh = shape.hidden, shape.head_dim
    total: Number = 0.0
    for i in range(shape.num_layers):
        h, kv = shape.heads[i], shape.kv_heads[i]
        a, c = _layer(values.mha_in, i), _layer(values.mha_out, i)
        a2, c2 = _layer(values.ffn_in, i), _layer(values.ffn_out, i)
        heads = _layer(values.head, i)
        kv_keep = _kv_heads(heads, h, kv)
        qk, vo = _layer(values.qk, i), _layer(values.vo, i)  # shared: z_Q = z_K, z_V = z_O
        rows_q = _head_dims(heads, _both(_layer(values.q, i), qk), h, dh)
        rows_k = _head_dims(kv_keep, _both(_layer(values.k, i), qk), kv, dh)
        rows_v = _head_dims(kv_keep, _both(_layer(values.v, i), vo), kv, dh)
        cols_o = _head_dims(heads, _both(_layer(values.o, i), vo), h, dh)
        n_in, n_out = _total(a, d), _total(c, d)
        attn = n_in * (rows_q + rows_k + rows_v) + n_out * cols_o
        n_f = _total(_layer(values.f, i), shape.ffn[i])
        n_in2, n_out2 = _total(a2, d), _total(c2, d)
        mlp = n_f * (n_in2 * (2 if shape.gated else 1) + n_out2)
        if include_bias:
            b = shape.bias
            attn = attn + rows_q * ("q" in b) + rows_k * ("k" in b) + rows_v * ("v" in b) + n_out * ("o" in b)
            mlp = mlp + n_f * ("up" in b) + n_f * ("gate" in b and shape.gated) + n_out2 * ("down" in b)
        z_mha, z_ffn = _layer(values.mha, i), _layer(values.ffn, i)
        total = total + (attn if z_mha is None else z_mha * attn) + (mlp if z_ffn is None else z_ffn * mlp)
        for block, (x, y) in enumerate(((a, c), (a2, c2))):
            if residual_blocks is None or residual_blocks[2 * i + block]:
                total = total + _residual(x, y, d, residual)
    return torch.as_tensor(total, dtype=torch.float64)


def dense_size(shape: MaskShape, *, include_bias: bool = False) -> int:
    """``M``: the counted weights of the dense model (no masks, no residual matrices)."""
    return int(expected_size(MaskValues(), shape, residual="none", include_bias=include_bias))


def expected_sparsity(
    values: MaskValues,
    shape: MaskShape,
    *,
    total: float | None = None,
    residual: Residual = "dense",
    residual_blocks: Sequence[bool] | None = None,
    include_bias: bool = False,
) -> torch.Tensor:
    """``ŝ = 1 − size / M`` (Eq. 30; ``M`` = :func:`dense_size` unless ``total`` is given)."""
    size = expected_size(values, shape, residual=residual, residual_blocks=residual_blocks, include_bias=include_bias)
    m = float(total) if total is not None else float(dense_size(shape, include_bias=include_bias))
    return 1.0 - size / m


def stream_model_size(
    values: MaskValues,
    shape: MaskShape,
    groups: Sequence[Sequence[int]],
    *,
    embedding_rows: int,
    head_rows: int = 0,
    head_map: bool = False,
    embedding_map: bool = False,
    include_bias: bool = False,
    fixed: int = 0,
    boundaries: Sequence[int] = (),
) -> torch.Tensor:
    """Every parameter of a pre-norm model whose residual stream is masked per layer group (``stream`` placement).

    ``boundaries``: layers whose down / fc2 writes the next group's stream (SP3 Eq. 34's group
    boundary, :mod:`slimkit.primitives.projection.fuse`); their rows are counted at that group's width.

    The count SP3's LLM setting needs (Appendix F: hidden dimensions and FFN filters, Group PCA),
    exact for 0/1 masks and the expectation for keep probabilities; with ``n_g = Σ z_g`` (the
    group's ``mha_in`` mask, or ``d`` without hidden masks):

    * the blocks: :func:`expected_size` without residual terms (q/k/v/gate/up read ``n_g``
      columns, o/down write ``n_g`` rows, FFN filters by ``z_f``);
    * the norms: two per layer of ``n_g`` weights and the final norm's ``n_G``;
    * the residual matrices at group boundaries, ``n_g × n_{g−1}`` (Eq. 18), and, with ``head_map``,
      the map from the last group to the tied embedding's coordinates after the final norm, ``n_1 × n_G``;
    * the embeddings (``embedding_rows`` = rows of every table writing the stream) in the first
      group's coordinates, and an untied head (``head_rows`` = its rows) in the last group's; with
      ``embedding_map`` (a tied embedding in its own basis, keeping as many coordinates as group 1) its
      map into group 1's coordinates, ``n_1 × n_1``;
    * ``fixed``: anything the masks do not touch (e.g. biases of q/k/v when not counted above).

    Unlike Eq. 30 (which follows CoFi and counts only the blocks), this is the whole model, so a
    target can be a fraction of the model's parameters like every other slimkit recipe.
    """
    blocks = expected_size(values, shape, residual="none", include_bias=include_bias)
    d = float(shape.hidden)
    widths = [d if values.mha_in is None else values.mha_in[group[0]].double().sum() for group in groups]
    total = blocks + fixed
    for g, group in enumerate(groups):
        total = total + 2 * len(group) * widths[g]
        if g > 0:
            total = total + widths[g] * widths[g - 1]
    total = total + widths[-1] + embedding_rows * widths[0] + head_rows * widths[-1]
    group_of = {i: g for g, group in enumerate(groups) for i in group}
    for i in boundaries:
        n_f = _total(_layer(values.f, i), shape.ffn[i]) + (include_bias and "down" in shape.bias)
        z_ffn = _layer(values.ffn, i)
        extra = n_f * (widths[group_of[i] + 1] - _total(_layer(values.ffn_out, i), d))
        total = total + (extra if z_ffn is None else z_ffn * extra)
    if head_map:
        total = total + widths[0] * widths[-1]
    if embedding_map:
        total = total + widths[0] * widths[0]
    return torch.as_tensor(total, dtype=torch.float64)


# -- Lagrangian ---------------------------------------------------------------------------------------


class Lagrangian(nn.Module):
    """Eq. 14: ``λ₁ (ŝ − t) + λ₂ (ŝ − t)²`` with learned multipliers (start at 0), to be maximised over."""

    def __init__(self) -> None:
        super().__init__()
        self.lambda_1 = nn.Parameter(torch.zeros(()))
        self.lambda_2 = nn.Parameter(torch.zeros(()))

    def forward(self, s_hat: torch.Tensor, target: float) -> torch.Tensor:
        gap = s_hat - target
        return self.lambda_1.to(gap.dtype) * gap + self.lambda_2.to(gap.dtype) * gap * gap


def lagrangian_optimizer(lagrangian: Lagrangian, lr: float) -> torch.optim.Optimizer:
    """AdamW that *ascends* the multipliers (``maximize=True``, no weight decay)."""
    return torch.optim.AdamW(lagrangian.parameters(), lr=lr, weight_decay=0.0, maximize=True)


def negate_gradients(module: nn.Module) -> list[RemovableHandle]:
    """Flip the gradients of ``module``'s parameters, so a minimising optimiser ascends them."""
    return [p.register_hook(torch.neg) for p in module.parameters()]


# -- binarisation -------------------------------------------------------------------------------------


def couple_intermediate(masks: MaskValues) -> MaskValues:
    """0/1 masks with ``z_Q = z_K = z_Q z_K`` and ``z_V = z_O = z_V z_O`` (dimensions a runnable model keeps)."""
    out = masks
    for left, right in (("q", "k"), ("v", "o")):
        x, y = getattr(masks, left), getattr(masks, right)
        if x is not None and y is not None:
            both = [p * q for p, q in zip(x, y, strict=True)]
            out = replace(out, **{left: both, right: list(both)})
    return out


@dataclass(frozen=True)
class Binarized:
    masks: MaskValues
    """0/1 masks (float32); fields absent from the scores stay ``None`` (all ones)."""
    threshold: float
    """Entries with score ``>= threshold`` are kept (``inf``: nothing kept); with ``tolerance``, the selection's own."""
    sparsity: float
    """The sparsity of the binary masks under the same count."""
    size: int


def binarize(
    scores: MaskValues,
    shape: MaskShape,
    target: float,
    *,
    total: float | None = None,
    residual: Residual = "dense",
    residual_blocks: Sequence[bool] | None = None,
    include_bias: bool = False,
    couple: bool = True,
    size: Callable[[MaskValues], torch.Tensor] | None = None,
    tolerance: float | None = None,
) -> Binarized:
    """The lowest global threshold on ``scores`` whose kept set reaches sparsity ``>= target`` (§3.2).

    ``scores`` holds one score per mask entry for the masks to binarise (e.g. :meth:`MaskSet.scores`);
    ``couple`` first intersects the QK and VO masks (:func:`couple_intermediate`), as the fused
    model will. ``size`` replaces the Eq. 30 count by another count of 0/1 masks (e.g.
    :func:`stream_model_size` for the whole model); the sparsity is then ``1 − size / total``.
    ``tolerance``: instead of the threshold, the budget-aware selection over every mask level of
    :func:`select_to_target` (sparsity in ``[target, target + tolerance]`` where the units allow), so a
    coarse unit (a block gate, a twelfth of the count) crossing the threshold does not overshoot the target.
    """
    names = scores.present()
    flat = torch.cat([t.detach().double().flatten() for _, values in scores.items() for t in values])
    count = dict(total=total, residual=residual, residual_blocks=residual_blocks, include_bias=include_bias)

    def masks_at(tau: float) -> MaskValues:
        masks = scores.map(lambda t: (t.detach() >= tau).float())
        return couple_intermediate(masks) if couple else masks

    if size is None:
        counted = {k: v for k, v in count.items() if k != "total"}

        def size(masks: MaskValues) -> torch.Tensor:
            return expected_size(masks, shape, **counted)

    m = float(total) if total is not None else float(dense_size(shape, include_bias=include_bias))

    def sparsity_at(tau: float) -> float:
        return 1.0 - float(size(masks_at(tau))) / m

    candidates = [*torch.unique(flat).tolist(), float("inf")] if names else [float("inf")]
    if sparsity_at(float("inf")) < target:
        raise SlimkitError(f"target sparsity {target} is out of reach: removing every masked unit gives less")
    lo, hi = 0, len(candidates) - 1  # sparsity is non-decreasing in the threshold; hi always meets the target
    while lo < hi:
        mid = (lo + hi) // 2
        if sparsity_at(candidates[mid]) >= target:
            hi = mid
        else:
            lo = mid + 1
    tau = candidates[hi]
    masks = masks_at(tau)
    if tolerance is not None and hi > 0:
        below = masks_at(candidates[hi - 1])  # the largest removal under the target: greedy removes it first
        selected = select_to_target(
            scores, below, lambda kept: 1.0 - float(size(kept)) / m, target, tolerance, couple=couple
        )
        if selected is not None:
            masks = selected
    sparsity = 1.0 - float(size(masks)) / m
    return Binarized(masks=masks, threshold=tau, sparsity=sparsity, size=round(float(size(masks))))


def select_to_target(
    scores: MaskValues,
    start: MaskValues,
    sparsity_of: Callable[[MaskValues], float],
    target: float,
    tolerance: float,
    *,
    couple: bool = True,
) -> MaskValues | None:
    """Remove further entries of 0/1 ``start`` masks, lowest score first, skipping any whose removal would take
    the sparsity above ``target + tolerance``, until it reaches ``target``; ``None`` if it cannot.

    Greedy over all mask levels together (hidden dimensions, filters, heads, layers): a block gate too
    big for what is left of the budget is kept and smaller units of the next scores are removed
    instead. A score tensor shared by several fields (one gate per norm) is one unit and is removed
    from all of them together. ``sparsity_of`` counts a 0/1 mask set (e.g. ``1 − size / M``); ``start`` is the
    largest threshold removal below the target (:func:`binarize`), which the greedy reaches first.
    """
    current = {name: [t.clone() for t in values] for name, values in start.items()}
    places: dict[int, list[tuple[str, int]]] = {}  # one gate shared by several fields is one unit
    tensors: dict[int, torch.Tensor] = {}
    for name, values in scores.items():
        for layer, t in enumerate(values):
            places.setdefault(id(t), []).append((name, layer))
            tensors[id(t)] = t
    kept = [
        (score, key, index)
        for key, t in tensors.items()
        for index, score in enumerate(t.detach().double().flatten().tolist())
        if current[places[key][0][0]][places[key][0][1]].view(-1)[index] != 0
    ]
    kept.sort(key=lambda entry: entry[0])

    def as_values() -> MaskValues:
        out = replace(start, **current)
        return couple_intermediate(out) if couple else out

    def put(key: int, index: int, value: float) -> None:
        for name, layer in places[key]:
            current[name][layer].view(-1)[index] = value

    for _, key, index in kept:
        put(key, index, 0.0)
        reached = sparsity_of(as_values())
        if reached > target + tolerance:
            put(key, index, 1.0)
        elif reached >= target:
            return as_values()
    return None
