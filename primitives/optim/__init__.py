"""Learned compression policies.

* :mod:`~slimkit.primitives.optim.policy`: PruneNet's calibration-free policy learner ("You Only Prune
  Once", Sengupta et al.): one small network scores the rows of every layer's FFN1 weight, is trained with
  REINFORCE to keep the weights' singular-value distribution (KS or Anderson–Darling distance, see
  :mod:`slimkit.primitives.spectrum`), and picks the MLP channels to keep at any ratio.
"""

from __future__ import annotations

from slimkit.primitives.optim.policy import (
    MAX_RATIO,
    RETURNS,
    SELECTIONS,
    PolicyReport,
    PruneNetPolicy,
    discounted_penalties,
    ffn_weights,
    layer_penalties,
    layer_ratios,
    load_policy,
    policy_keep_indices,
    reparameterize,
    save_policy,
    sequential_log_prob,
    train_policy,
)

__all__ = [
    "MAX_RATIO",
    "RETURNS",
    "SELECTIONS",
    "PolicyReport",
    "PruneNetPolicy",
    "discounted_penalties",
    "ffn_weights",
    "layer_penalties",
    "layer_ratios",
    "load_policy",
    "policy_keep_indices",
    "reparameterize",
    "save_policy",
    "sequential_log_prob",
    "train_policy",
]
