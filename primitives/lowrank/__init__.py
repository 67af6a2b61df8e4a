"""Low-rank factorisation of Linear layers (LoRAP, Li et al. 2024, arXiv:2404.09695).

* :mod:`.svd`: :func:`truncated_svd` (Eq. 4), :func:`activation_weighted_svd` (AWSVD, Eqs. 5–7) and
  :func:`whitened_svd` (SVD-LLM's whitening with the full input Gram), pure tensor functions returning
  ``(L, R)`` with ``W ≈ L @ R``.
* :mod:`.module`: :class:`LowRankLinear` (``second(first(x))``, Eq. 3), its manifest records and
  the helpers a loader and surgery need (:func:`lowrank_entries`, :func:`materialise_lowrank`,
  :func:`member_target`).
* :mod:`.allocation`: rank arithmetic, the speed rule (:func:`max_useful_rank`), LoRAP's 1:3
  attention parameter allocation with the Appendix C special case (:func:`allocate_attention`),
  and the layer-level ratio of Appendix C.1 (:func:`layer_ratio`).
* :mod:`.rank_allocation`: one budget shared among many matrices by their weighted spectra
  (:func:`~slimkit.primitives.lowrank.rank_allocation.allocate_ranks`, issue 30).

Speed, measured on the 2-core development CPU (torch 2.13, float32, input ``[1, 128, 576]``,
median of 20 interleaved runs, background load present): SmolLM2-135M layer-0 ``q_proj``
(576 x 576, dense ≈ 0.47 ms) as a :class:`LowRankLinear` takes 0.17 / 0.32 / 0.53 / 0.74 / 0.96 /
1.08 / 1.99 x the dense time at ranks 16 / 64 / 128 / 192 / 256 / 287 / 576 (MAC ratios 0.06 /
0.22 / 0.44 / 0.67 / 0.89 / 1.00 / 2.00); ``k_proj`` (192 x 576, dense ≈ 0.16 ms) takes 0.30 /
0.66 / 0.95 / 1.27 x at ranks 16 / 72 / 108 / 143 (MAC ratios 0.11 / 0.50 / 0.75 / 0.99). Far
below the break-even, time follows MACs; near it, two thin matmuls are slower than one dense
matmul, so the MAC break-even (:func:`max_useful_rank` with ``mac_fraction=1``) is not enough to
be no slower than dense: ``mac_fraction=0.75`` was no slower for both shapes.
"""

from slimkit.primitives.lowrank.module import LowRankLinear, lowrank_entries, materialise_lowrank, member_target
from slimkit.primitives.lowrank.rank_budget import (
    allocate_attention,
    allocated_params,
    dense_params,
    layer_ratio,
    lowrank_params,
    max_useful_rank,
    rank_for_budget,
)
from slimkit.primitives.lowrank.svd import (
    activation_weighted_svd,
    clamp_norms,
    singular_energies,
    truncated_svd,
    weighted_error,
    whitened_svd,
)

__all__ = [
    "LowRankLinear",
    "activation_weighted_svd",
    "allocate_attention",
    "allocated_params",
    "clamp_norms",
    "dense_params",
    "layer_ratio",
    "lowrank_entries",
    "lowrank_params",
    "materialise_lowrank",
    "max_useful_rank",
    "member_target",
    "rank_for_budget",
    "singular_energies",
    "truncated_svd",
    "weighted_error",
    "whitened_svd",
]
