"""OBS saliency of MLP channels and attention heads (ZipLM / SlimGPT's structured OBS, one shot).

Method note: docs/methods/reconstruct-obs.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group

OBS_CONSUMERS: dict[str, LinearRole] = {"mlp_channel": "down", "attention_head": "o"}
"""The role whose input columns a kind's units are (its Gram is the OBS Hessian)."""
OBS_KINDS: tuple[str, ...] = tuple(OBS_CONSUMERS)


def consumer_inputs(
    group: Group, model: nn.Module, stats: Mapping, who: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight the group's units are input columns of (down_proj, o_proj), that consumer's input Gram from the
    layer's statistics, and the ``[units, per_unit]`` columns; a missing consumer or a Gram that no longer matches
    the weight is refused in one line starting with ``who``."""
    role = OBS_CONSUMERS[group.kind]
    consumers = stats["dense_consumers"]
    if role not in consumers:
        raise SlimkitError(f"{who}: layer {group.layer} has no {role} Gram (have: {', '.join(sorted(consumers))})")
    member = next((m for m in group.members if m.param == "weight" and m.dim == 1), None)
    if member is None:
        raise SlimkitError(f"{who}: layer {group.layer} {group.kind} has no consumer columns")
    weight = member.tensor(model).detach()
    gram = consumers[role].gram
    if gram.shape != (weight.shape[1], weight.shape[1]):
        raise SlimkitError(
            f"{who}: layer {group.layer} {role} has {weight.shape[1]} inputs, its Gram {gram.shape[0]} "
            "(a stage changed it after the statistics pass)"
        )
    return weight, gram, member.indices


def obs_scores(group: Group, model: nn.Module, stats: Mapping, **_) -> torch.Tensor:
    """One-shot OBS cost of removing each unit alone, with the optimal update of its consumer."""
    from slimkit.primitives.reconstruct import DEFAULT_OBS_DAMPING, inverse_hessian, obs_costs

    weight, gram, columns = consumer_inputs(group, model, stats, "scorer obs")
    hinv, _info = inverse_hessian(gram, DEFAULT_OBS_DAMPING)
    return obs_costs(weight, hinv, list(columns)).float()
