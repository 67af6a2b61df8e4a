"""Low-rank factorisation of Linear layers (LoRAP, Li et al. 2024, arXiv:2404.09695).

Method note: docs/methods/lowrank-allocation.md.
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
