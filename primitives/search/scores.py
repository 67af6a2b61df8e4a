"""A candidate's score: the KL divergence of the model's next-token distribution from the dense model's when the
candidate alone replaces its parent, on held-out calibration tokens (the allocation search's fitness,
:func:`~slimkit.primitives.allocate.fitness.mean_kl`), with the unchanged layers before it skipped
(:func:`~.prefix.cached_prefix`).

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slimkit.primitives.allocate.fitness import mean_kl
from slimkit.primitives.search.build import applied
from slimkit.primitives.search.prefix import cached_prefix
from slimkit.primitives.search.record import CandidateRecord


def candidate_kl(
    model: nn.Module,
    record: CandidateRecord,
    held_out: Sequence[torch.Tensor],
    dense: Sequence[torch.Tensor],
    layer_inputs: Sequence[torch.Tensor],
) -> float:
    """``KL(dense || model with record)`` averaged over the held-out positions; ``layer_inputs``: the dense hidden
    states entering ``record.layer`` on each held-out batch."""
    with applied(model, record), cached_prefix(model, record.layer, layer_inputs):
        return mean_kl(model, held_out, dense)


__all__ = ["candidate_kl"]
