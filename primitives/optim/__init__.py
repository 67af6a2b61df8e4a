"""Learned compression policies.

* :mod:`~slimkit.primitives.optim.policy`: PruneNet's calibration-free policy learner ("You Only Prune
  Once", Sengupta et al.): one small network scores the rows of every layer's FFN1 weight, is trained with
  REINFORCE to keep the weights' singular-value distribution (KS or Anderson–Darling distance, see
  :mod:`slimkit.primitives.spectrum`), and picks the MLP channels to keep at any ratio.
* :mod:`~slimkit.primitives.optim.masks`: hard-concrete (L0) gates and SP3's dimension / head / layer
  masks (:class:`MaskSet`), applied to a Hugging Face model by hooks (:func:`apply_masks`).
* :mod:`~slimkit.primitives.optim.sparsity`: SP3's expected sparsity (Appendix C, Eq. 30), the Lagrangian
  pruning loss (Eq. 14) and the final threshold that meets a target (:func:`binarize`).
* :mod:`~slimkit.primitives.optim.schedule`: SP3's multi-stage mask schedule (§3.2, Appendix D.2).
* :mod:`~slimkit.primitives.optim.encoder_masks`: the same for BERT on a GLUE task
  (:func:`~slimkit.primitives.optim.encoder_masks.train_encoder_masks`).
* :mod:`~slimkit.primitives.optim.mask_training`: SP3's LLM mask training (weights, masks and
  Lagrangian together), binarisation and fusing (:func:`train_stream_masks`).
* :mod:`~slimkit.primitives.optim.fusing`: trained hidden and FFN masks folded into a pre-norm
  decoder's weights (§3.3, Appendix F).
"""

from __future__ import annotations

from slimkit.primitives.optim.fusing import fuse_stream_masks, stream_count_args
from slimkit.primitives.optim.mask_training import MaskTrainingConfig, train_stream_masks
from slimkit.primitives.optim.masks import (
    DEFAULT_CONFIG,
    HIDDEN_FIELDS,
    INTERMEDIATE_FIELDS,
    LEVEL_OF,
    LEVELS,
    MASK_FIELDS,
    HardConcrete,
    HardConcreteConfig,
    MaskHooks,
    MaskSet,
    MaskShape,
    MaskValues,
    apply_masks,
    expected_value,
    hard_concrete_deterministic,
    hard_concrete_sample,
    keep_probability,
    log_alpha_for_drop,
    one_probability,
    resolve_placement,
)
from slimkit.primitives.optim.policy import (
    MAX_RATIO,
    RETURNS,
    SELECTIONS,
    UPDATES,
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
from slimkit.primitives.optim.schedule import MaskSchedule, Stage
from slimkit.primitives.optim.sparsity import (
    RESIDUALS,
    Binarized,
    Lagrangian,
    binarize,
    couple_intermediate,
    dense_size,
    expected_size,
    expected_sparsity,
    lagrangian_optimizer,
    negate_gradients,
    stream_model_size,
)

__all__ = [
    "DEFAULT_CONFIG",
    "HIDDEN_FIELDS",
    "INTERMEDIATE_FIELDS",
    "LEVELS",
    "LEVEL_OF",
    "MASK_FIELDS",
    "MAX_RATIO",
    "RESIDUALS",
    "RETURNS",
    "SELECTIONS",
    "UPDATES",
    "Binarized",
    "HardConcrete",
    "HardConcreteConfig",
    "Lagrangian",
    "MaskHooks",
    "MaskSchedule",
    "MaskSet",
    "MaskShape",
    "MaskTrainingConfig",
    "MaskValues",
    "PolicyReport",
    "PruneNetPolicy",
    "Stage",
    "apply_masks",
    "binarize",
    "couple_intermediate",
    "dense_size",
    "discounted_penalties",
    "expected_size",
    "expected_sparsity",
    "expected_value",
    "ffn_weights",
    "fuse_stream_masks",
    "hard_concrete_deterministic",
    "hard_concrete_sample",
    "keep_probability",
    "lagrangian_optimizer",
    "layer_penalties",
    "layer_ratios",
    "load_policy",
    "log_alpha_for_drop",
    "negate_gradients",
    "one_probability",
    "policy_keep_indices",
    "reparameterize",
    "resolve_placement",
    "save_policy",
    "sequential_log_prob",
    "stream_count_args",
    "stream_model_size",
    "train_policy",
    "train_stream_masks",
]
