"""Optimal-brain-surgeon structured selection and update (ZipLM, SlimGPT style).

Greedy removal of input groups of a consumer by their OBS cost, with the optimal update of the remaining columns.

Method note: docs/methods/reconstruct-obs.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slimkit.primitives.reconstruct.error import Indices, as_indices
from slimkit.primitives.reconstruct.solve import DEFAULT_OBS_DAMPING, SolveInfo, damped_inverse

Groups = Sequence[Indices]


def contiguous_groups(width: int, size: int) -> list[list[int]]:
    """``[[0..size-1], [size..2size-1], ...]``: heads (``size = head_dim``), KV groups
    (``size = head_dim · heads_per_kv``) or channels (``size = 1``) of a consumer's input."""
    if size < 1 or width % size:
        raise ValueError(f"width {width} is not a positive multiple of group size {size}")
    return [list(range(start, start + size)) for start in range(0, width, size)]


def _check_groups(groups: Groups, width: int) -> list[torch.Tensor]:
    checked = [as_indices(group, width, f"group {i}") for i, group in enumerate(groups)]
    if any(group.numel() == 0 for group in checked):
        raise ValueError("groups must be non-empty")
    if checked:
        every = torch.cat(checked)
        if every.unique().numel() != every.numel():
            raise ValueError("groups must be disjoint")
    return checked


def _check_pair(weight: torch.Tensor, hinv: torch.Tensor) -> None:
    if weight.dim() != 2 or hinv.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"expected W (d_out x d_in) and Hinv (d_in x d_in), got {tuple(weight.shape)} and {tuple(hinv.shape)}"
        )


def inverse_hessian(
    hessian: torch.Tensor, damping: float = DEFAULT_OBS_DAMPING, retries: int = 3
) -> tuple[torch.Tensor, SolveInfo]:
    """``(H + λI)⁻¹`` (float64, on ``H``'s device), ``λ = damping · mean(diag(H))``, and how it was computed."""
    return damped_inverse(hessian, damping, retries)


def _block_inverse(blocks: torch.Tensor) -> torch.Tensor:
    """Inverses of a batch ``[g, s, s]`` of symmetric positive-definite blocks (pinv where Cholesky fails)."""
    blocks = (blocks + blocks.transpose(-1, -2)) / 2
    factor, status = torch.linalg.cholesky_ex(blocks)
    inverse = torch.cholesky_inverse(factor)
    bad = (status != 0) | ~torch.isfinite(inverse).flatten(1).all(dim=1)
    if bad.any():
        inverse[bad] = torch.linalg.pinv(blocks[bad], hermitian=True)
    return inverse


def _block_costs(w: torch.Tensor, hinv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tr(W_S (Hinv_SS)⁻¹ W_Sᵀ)`` for each row ``S`` of ``index`` (``[g, s]``), clamped at 0."""
    blocks = hinv[index[:, :, None], index[:, None, :]]
    ws = w[:, index].permute(1, 0, 2)  # g, d_out, s
    inverse = _block_inverse(blocks)
    return ((ws @ inverse) * ws).sum(dim=(1, 2)).clamp_min(0)


class _Buckets:
    """Groups batched by size: ``{size: (group ids, [g, size] column index)}`` on a device."""

    def __init__(self, groups: list[torch.Tensor], device: torch.device) -> None:
        by_size: dict[int, list[int]] = {}
        for gid, group in enumerate(groups):
            by_size.setdefault(group.numel(), []).append(gid)
        self.buckets = [
            (torch.tensor(ids), torch.stack([groups[i] for i in ids]).to(device)) for ids in by_size.values()
        ]
        self.count = len(groups)

    def costs(self, w: torch.Tensor, hinv: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Costs of the ``active`` groups (``inf`` for the others), indexed by group id."""
        out = torch.full((self.count,), float("inf"), dtype=torch.float64, device=w.device)
        for ids, index in self.buckets:
            live = active[ids]
            if live.any():
                out[ids[live].to(w.device)] = _block_costs(w, hinv, index[live.to(index.device)])
        return out


def _remove_(w: torch.Tensor, hinv: torch.Tensor, s: torch.Tensor) -> float:
    """One OBS step for the column index ``s``, updating float64 ``w`` and ``hinv`` in place; returns the cost."""
    inverse = _block_inverse(hinv[s][:, s].unsqueeze(0))[0]
    ws = w[:, s]
    scaled = ws @ inverse
    cost = max(float((scaled * ws).sum()), 0.0)
    rows = hinv[s, :]  # a copy (advanced indexing), so the in-place updates below do not alias it
    w.addmm_(scaled, rows, alpha=-1)
    hinv.addmm_(rows.T, inverse @ rows, alpha=-1)
    w[:, s] = 0
    hinv[s, :] = 0
    hinv[:, s] = 0
    return cost


@dataclass(frozen=True)
class ObsStep:
    """One OBS removal: the updated ``W`` (column ``S`` zero), downdated ``Hinv`` and the step's cost."""

    weight: torch.Tensor
    hinv: torch.Tensor
    cost: float


def obs_remove(weight: torch.Tensor, hinv: torch.Tensor, group: Indices) -> ObsStep:
    """Remove input columns ``group`` from ``W`` with the OBS update and downdate ``Hinv`` (see the module doc).

    Computed in float64 on ``Hinv``'s device; returns ``W`` in its dtype/device, ``Hinv`` in its own."""
    _check_pair(weight, hinv)
    s = as_indices(group, weight.shape[1], "group")
    if s.numel() == 0:
        raise ValueError("group must be non-empty")
    h = hinv.detach().to(dtype=torch.float64, copy=True)
    s = s.to(h.device)
    w = weight.detach().to(device=h.device, dtype=torch.float64, copy=True)
    cost = _remove_(w, h, s)
    return ObsStep(w.to(device=weight.device, dtype=weight.dtype), h.to(hinv.dtype), cost)


def obs_costs(weight: torch.Tensor, hinv: torch.Tensor, groups: Groups) -> torch.Tensor:
    """One-shot cost ``tr(W_S (Hinv_SS)⁻¹ W_Sᵀ)`` of removing each group alone (float64, length ``len(groups)``).

    For single columns this is ``||W[:, j]||² / Hinv_jj``, the OBS saliency."""
    _check_pair(weight, hinv)
    checked = _check_groups(groups, weight.shape[1])
    h = hinv.detach().double()
    w = weight.detach().to(device=h.device, dtype=torch.float64)
    if not checked:
        return torch.zeros(0, dtype=torch.float64, device=h.device)
    return _Buckets(checked, h.device).costs(w, h, torch.ones(len(checked), dtype=torch.bool))


def _round_picks(costs: torch.Tensor, per_update: int, left: int, quota_left: list[int], size: int) -> list[int]:
    """The groups one update removes: the ``per_update`` cheapest (at most ``left``), skipping groups of a block
    whose quota this pick fills."""
    quota = list(quota_left)
    picks: list[int] = []
    for gid in torch.argsort(costs, stable=True).tolist():
        if len(picks) == min(per_update, left) or not bool(torch.isfinite(costs[gid])):
            break
        block = gid // size
        if quota[block] > 0:
            quota[block] -= 1
            picks.append(gid)
    return picks


def _greedy(
    w: torch.Tensor,
    hinv: torch.Tensor,
    groups: list[torch.Tensor],
    n_remove: int,
    blocks: int = 1,
    per_update: int = 1,
) -> tuple[list[int], list[float], torch.Tensor, torch.Tensor]:
    """The greedy loop; updates float64 ``w`` and ``hinv`` in place (callers pass copies).

    With ``blocks > 1`` the groups form ``blocks`` equal consecutive blocks (GQA query heads per KV
    head) and each block loses ``n_remove / blocks`` of them: every step takes the cheapest group
    among the blocks that still have removals left.

    ``per_update > 1`` is SlimGPT's batched greedy: each round ranks the groups by their cost on the current ``W``
    and ``Hinv``, takes the ``per_update`` cheapest and removes them together by one exact OBS step on the union of
    their columns (the sub-inverse of that union), so ``Hinv`` is updated once per round instead of once per group.
    A round's joint cost is shared equally among its groups in the returned costs (their sum is exact).
    ``per_update = 1`` is the one-at-a-time greedy."""
    if not 0 <= n_remove <= len(groups):
        raise ValueError(f"n_remove must be in [0, {len(groups)}], got {n_remove}")
    if blocks < 1 or len(groups) % blocks or n_remove % blocks:
        raise ValueError(f"{len(groups)} groups / remove {n_remove} do not split evenly over {blocks} blocks")
    if per_update < 1:
        raise ValueError(f"per_update must be at least 1, got {per_update}")
    buckets = _Buckets(groups, hinv.device)
    active = torch.ones(len(groups), dtype=torch.bool)
    per_block, size = n_remove // blocks, len(groups) // blocks
    quota_left = [per_block] * blocks
    order: list[int] = []
    costs: list[float] = []
    while len(order) < n_remove:
        picks = _round_picks(buckets.costs(w, hinv, active).cpu(), per_update, n_remove - len(order), quota_left, size)
        columns = torch.cat([groups[gid] for gid in picks]).to(hinv.device)
        cost = _remove_(w, hinv, columns)
        for gid in picks:
            active[gid] = False
            block = gid // size
            quota_left[block] -= 1
            if quota_left[block] == 0:  # this block's quota is met: its other groups stay
                active[block * size : (block + 1) * size] = False
        order.extend(picks)
        costs.extend([cost / len(picks)] * len(picks))
    return order, costs, w, hinv


@dataclass(frozen=True)
class ObsOrder:
    """Greedy OBS removal order (group indices, first removed first) and each step's cost (float64)."""

    order: list[int]
    costs: torch.Tensor


def obs_order(
    weight: torch.Tensor, hinv: torch.Tensor, groups: Groups, n_remove: int | None = None, per_update: int = 1
) -> ObsOrder:
    """The greedy OBS order: repeatedly remove the cheapest group (``per_update`` at a time, see :func:`_greedy`) and
    update ``W`` and ``Hinv``.

    ``n_remove`` steps (all groups when None). ``costs[i]`` is the increase of the layer-wise loss
    at step ``i``, so ``costs.cumsum(0)`` is the loss after each step (after each round with ``per_update > 1``)."""
    _check_pair(weight, hinv)
    checked = _check_groups(groups, weight.shape[1])
    h = hinv.detach().to(dtype=torch.float64, copy=True)
    w = weight.detach().to(device=h.device, dtype=torch.float64, copy=True)
    order, costs, _, _ = _greedy(w, h, checked, len(checked) if n_remove is None else n_remove, 1, per_update)
    return ObsOrder(order, torch.tensor(costs, dtype=torch.float64))


@dataclass(frozen=True)
class ObsPrune:
    """Result of :func:`obs_prune`.

    ``weight`` is the compact updated consumer ``d_out x len(kept_columns)`` (``W``'s dtype and device),
    ``kept_columns`` the ascending input columns it reads, ``kept_groups`` the surviving group indices
    (ascending), ``removed_groups`` the removed ones in removal order with their step ``costs``, and
    ``info`` how ``(H + λI)⁻¹`` was computed."""

    weight: torch.Tensor
    kept_columns: torch.Tensor
    kept_groups: list[int]
    removed_groups: list[int]
    costs: torch.Tensor
    info: SolveInfo


def obs_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    groups: Groups,
    n_remove: int,
    *,
    damping: float = DEFAULT_OBS_DAMPING,
    retries: int = 3,
    blocks: int = 1,
    per_update: int = 1,
) -> ObsPrune:
    """Greedy structured OBS: remove ``n_remove`` of ``groups`` from ``W`` given ``H = Σ_t x_t x_tᵀ``.

    Inverts ``H + λI`` (:func:`inverse_hessian`), runs :func:`obs_order`'s greedy loop while updating
    ``W``, then drops the removed columns (embed with
    :func:`~slimkit.primitives.reconstruct.error.embed_columns` for the zero-filled form). ``blocks > 1``
    removes ``n_remove / blocks`` groups from each of that many equal consecutive blocks of ``groups``
    (GQA: the same number of query heads from every KV group). ``per_update > 1`` removes that many groups per
    update of ``Hinv`` (SlimGPT's batched greedy, exact OBS on each round's union of columns)."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"expected W (d_out x d_in) and H (d_in x d_in), got {tuple(weight.shape)} and {tuple(hessian.shape)}"
        )
    checked = _check_groups(groups, weight.shape[1])
    hinv, info = inverse_hessian(hessian, damping, retries)
    w = weight.detach().to(device=hinv.device, dtype=torch.float64, copy=True)
    order, costs, w, _ = _greedy(w, hinv, checked, n_remove, blocks, per_update)
    keep = torch.ones(weight.shape[1], dtype=torch.bool)
    for gid in order:
        keep[checked[gid]] = False
    kept_columns = keep.nonzero().flatten()
    compact = w[:, kept_columns.to(w.device)]
    return ObsPrune(
        weight=compact.to(device=weight.device, dtype=weight.dtype),
        kept_columns=kept_columns,
        kept_groups=sorted(set(range(len(checked))) - set(order)),
        removed_groups=order,
        costs=torch.tensor(costs, dtype=torch.float64),
        info=info,
    )


__all__ = [
    "Groups",
    "ObsOrder",
    "ObsPrune",
    "ObsStep",
    "contiguous_groups",
    "inverse_hessian",
    "obs_costs",
    "obs_order",
    "obs_prune",
    "obs_remove",
]
