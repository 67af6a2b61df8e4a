"""Learned compression policies: PruneNet's calibration-free channel policy (:mod:`.prunenet`)."""

from __future__ import annotations

from slimkit.primitives.policy.prunenet import (
    PruneNetPolicy,
    load_policy,
    policy_keep_indices,
    save_policy,
    train_policy,
)

__all__ = ["PruneNetPolicy", "load_policy", "policy_keep_indices", "save_policy", "train_policy"]
