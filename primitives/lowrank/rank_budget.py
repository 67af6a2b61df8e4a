"""Rank arithmetic and LoRAP's parameter allocation in the attention sub-layer.

Method note: docs/methods/lowrank-allocation.md.
"""

from __future__ import annotations

import math
from fractions import Fraction

from slimkit.primitives.arch.view import LinearRole

QK_GROUP: tuple[LinearRole, ...] = ("q", "k")
VO_GROUP: tuple[LinearRole, ...] = ("v", "o")
ATTENTION_ROLES: tuple[LinearRole, ...] = (*QK_GROUP, *VO_GROUP)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def dense_params(d_in: int, d_out: int) -> int:
    """Weight entries (= MACs per token) of a dense ``d_out x d_in`` Linear: ``d_in·d_out``."""
    return _positive_int("d_in", d_in) * _positive_int("d_out", d_out)


def lowrank_params(d_in: int, d_out: int, r: int) -> int:
    """Weight entries (= MACs per token) of a rank-``r`` pair ``L R``: ``r·(d_in + d_out)``."""
    return _positive_int("r", r) * (_positive_int("d_in", d_in) + _positive_int("d_out", d_out))


def rank_for_budget(d_in: int, d_out: int, params: int) -> int:
    """The largest ``r`` with ``r·(d_in + d_out) <= params`` (floor), at least 1.

    E.g. ``d_in=576, d_out=192, params=76_800`` gives ``76_800 // 768 = 100``. A budget below
    ``d_in + d_out`` still gives 1 (the smallest factorisation); callers that must not exceed the
    budget check :func:`lowrank_params`.
    """
    if isinstance(params, bool) or not isinstance(params, int) or params < 0:
        raise ValueError(f"params must be a non-negative int, got {params!r}")
    width = _positive_int("d_in", d_in) + _positive_int("d_out", d_out)
    return max(1, params // width)


def max_useful_rank(d_in: int, d_out: int, mac_fraction: float = 1.0) -> int:
    """The largest ``r`` with ``r·(d_in + d_out) < mac_fraction·d_in·d_out``.

    With the default ``mac_fraction=1`` this is the MAC (and parameter) break-even:
    ``(d_in·d_out − 1) // (d_in + d_out)``, 287 for 576 x 576 and 143 for 192 x 576. Two thin
    matmuls cost more per MAC than one dense matmul, so on real hardware the wall-time break-even
    comes earlier (the measurement: docs/methods/lowrank-allocation.md, ``primitives/lowrank/__init__.py``);
    ``mac_fraction < 1`` leaves that margin. 0 means no factorisation of that shape qualifies.
    """
    if not 0.0 < mac_fraction <= 1.0:
        raise ValueError(f"mac_fraction must be in (0, 1], got {mac_fraction}")
    limit = Fraction(mac_fraction) * dense_params(d_in, d_out)
    return max(0, math.ceil(limit / (d_in + d_out)) - 1)


def _shape(shapes: dict[str, tuple[int, int]], role: str) -> tuple[int, int]:
    """``(d_in, d_out)`` of ``role`` from a ``(d_out, d_in)`` entry."""
    d_out, d_in = (int(x) for x in shapes[role])
    return d_in, d_out


def allocate_attention(
    shapes: dict[str, tuple[int, int]], budget: int, qk_share: float = 0.25, mac_fraction: float = 1.0
) -> dict[str, int | None]:
    """Ranks for ``q``, ``k``, ``v``, ``o`` under a total weight budget (LoRAP §3.2 and Appendix C).

    ``shapes[role] = (d_out, d_in)`` (``weight.shape``) for each of ``q, k, v, o``; ``budget`` is the
    number of weight entries the four matrices may keep together. Returns ``role -> rank``, or
    ``role -> None`` where the matrix stays dense.

    1. Groups (§3.2, Table 6): ``(W_q + W_k)`` receives ``qk_share`` of the budget and
       ``(W_v + W_o)`` the rest; the default ``0.25`` is the paper's chosen ratio 1:3.
    2. Special Case (Appendix C): a group whose share is at least its dense parameter count is
       kept dense (its ranks would reach the break-even rank, where a factorisation stops saving
       parameters and MACs), and the surplus ``share − dense`` goes to the other group. E.g. four
       equal square matrices at 80% kept: VO's share 0.6 of the total exceeds its 0.5, so W_v, W_o
       stay dense and W_q, W_k keep 60% of theirs, as in the paper's 20% example.
    3. Within a group the budget is split in proportion to the matrices' dense parameter counts,
       so every matrix of a group keeps the same fraction of its parameters (the paper, on LLaMA
       where all four matrices are square and equal, does not say; this reading reduces to equal
       ranks there). Under GQA, ``W_k`` (and ``W_v``) are smaller than ``W_q`` (``W_o``) and get
       proportionally fewer parameters, not the same rank.
    4. Speed cap: no rank exceeds :func:`max_useful_rank` ``(d_in, d_out, mac_fraction)``. With the
       default ``mac_fraction=1`` this binds at most within one rank of the break-even (a share
       below the dense count already gives ranks below it). With ``mac_fraction < 1`` (a wall-time margin, see
       :func:`max_useful_rank`), a group whose share exceeds what its capped ranks can hold is
       clamped to that, and the excess goes to the other group up to that group's own cap; what
       neither can use is left unspent (the result then keeps fewer than ``budget`` entries).
    5. Each rank is ``floor(params / (d_in + d_out))`` (:func:`rank_for_budget`), at most the cap;
       a matrix whose cap is 0 stays dense. Round-down leftovers are not redistributed, so the
       result keeps at most ``budget`` entries (unless a share is below ``d_in + d_out``, where
       rank 1 is the floor).

    A budget at or above the four dense counts keeps everything dense.
    """
    missing = [r for r in ATTENTION_ROLES if r not in shapes]
    extra = [r for r in shapes if r not in ATTENTION_ROLES]
    if missing or extra:
        raise ValueError(f"shapes must have exactly the roles q, k, v, o (missing {missing}, unexpected {extra})")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int, got {budget!r}")
    if not 0.0 < qk_share < 1.0:
        raise ValueError(f"qk_share must be in (0, 1), got {qk_share}")
    caps = {role: max_useful_rank(*_shape(shapes, role), mac_fraction) for role in ATTENTION_ROLES}

    dense = {role: dense_params(*_shape(shapes, role)) for role in ATTENTION_ROLES}
    groups = {"qk": QK_GROUP, "vo": VO_GROUP}
    group_dense = {g: sum(dense[r] for r in roles) for g, roles in groups.items()}
    if budget >= sum(group_dense.values()):
        return dict.fromkeys(ATTENTION_ROLES)

    share = {"qk": budget * qk_share, "vo": budget * (1.0 - qk_share)}
    kept_dense: set[str] = set()
    # At most one group can overflow, since budget < dense total; its surplus goes to the other.
    for group, other in (("qk", "vo"), ("vo", "qk")):
        if share[group] >= group_dense[group]:
            share[other] += share[group] - group_dense[group]
            share[group] = float(group_dense[group])
            kept_dense.add(group)
    # Speed cap: what a group's capped ranks can hold; the excess moves to the other group's room.
    room = {
        g: float(sum(lowrank_params(*_shape(shapes, r), caps[r]) for r in roles if caps[r]))
        for g, roles in groups.items()
    }
    for group, other in (("qk", "vo"), ("vo", "qk")):
        if group in kept_dense or share[group] <= room[group]:
            continue
        excess, share[group] = share[group] - room[group], room[group]
        if other not in kept_dense:
            share[other] = min(share[other] + excess, max(share[other], room[other]))

    ranks: dict[str, int | None] = {}
    for group, roles in groups.items():
        for role in roles:
            if group in kept_dense:
                ranks[role] = None
                continue
            d_in, d_out = _shape(shapes, role)
            params = math.floor(share[group] * dense[role] / group_dense[group])
            cap = caps[role]
            ranks[role] = min(rank_for_budget(d_in, d_out, params), cap) if cap >= 1 else None
    return {role: ranks[role] for role in ATTENTION_ROLES}


def allocated_params(shapes: dict[str, tuple[int, int]], ranks: dict[str, int | None]) -> int:
    """Weight entries kept by ``ranks`` (dense count where the rank is None)."""
    total = 0
    for role, rank in ranks.items():
        d_in, d_out = _shape(shapes, role)
        total += dense_params(d_in, d_out) if rank is None else lowrank_params(d_in, d_out, rank)
    return total


def layer_ratio(total_params: int, model_ratio: float, num_layers: int, layer_params: int) -> float:
    """Compression ratio the layers need so the whole model loses ``model_ratio`` (Appendix C.1).

    ``Ratio_l = Param_total × Ratio_s / (layers × Param_layer)``: embeddings and the LM head are
    not compressed, so the transformer layers must lose the whole ``Param_total × Ratio_s``.
    ``layer_params`` is one layer's *compressible* parameters (its attention and MLP weights).
    Raises ``ValueError`` when the result is ``>= 1`` (the layers cannot give up that much).
    """
    _positive_int("total_params", total_params)
    _positive_int("num_layers", num_layers)
    _positive_int("layer_params", layer_params)
    if not 0.0 <= model_ratio < 1.0:
        raise ValueError(f"model_ratio must be in [0, 1), got {model_ratio}")
    ratio = total_params * model_ratio / (num_layers * layer_params)
    if ratio >= 1.0:
        raise ValueError(
            f"removing {model_ratio:.1%} of {total_params:,} parameters needs {ratio:.1%} of the "
            f"{num_layers} x {layer_params:,} compressible layer parameters; at most just below 100% is possible"
        )
    return ratio


__all__ = [
    "ATTENTION_ROLES",
    "QK_GROUP",
    "VO_GROUP",
    "allocate_attention",
    "allocated_params",
    "dense_params",
    "layer_ratio",
    "lowrank_params",
    "max_useful_rank",
    "rank_for_budget",
]
