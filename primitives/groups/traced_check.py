"""The architecture data checked against the model's own computation graph.

torch-pruning traces a forward pass and finds which parameter dimensions are coupled: every tensor that reads or
writes the residual stream (one group over the hidden width) and, inside each MLP, the rows of its input projections
with the columns of its output projection. Where that tracing is exact, it needs no architecture data; what tracing
cannot know stays data (:class:`~slimkit.primitives.arch.spec.ArchSpec`: which projection is a query or a key, which
norm is a block's input or its branch post-norm, what a runtime reads from the config). :func:`trace_differences`
compares the couplings the spec implies with the traced ones, so a new family's data is checked by the model itself.

Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.groups import Group, hidden_feature_group, mlp_channel_group
from slimkit.primitives.groups.torch_pruning import dependency_graph_groups


def coupled_dims(group: Group) -> set[tuple[str, int]]:
    """``(parameter, dimension)`` pairs a group removes units along."""
    return {(member.key, member.dim) for member in group.members}


def _first_traced(groups: list[Group], kind: str, layer: int | None) -> Group | None:
    return next((g for g in groups if g.kind == kind and g.layer == layer), None)


def trace_differences(model: nn.Module, example_ids: torch.Tensor) -> list[str]:
    """What the spec's couplings and torch-pruning's traced ones disagree on (empty: they agree), one line each.

    Compared where the trace is exact: the residual stream's group (every embedding, projection and norm on the
    hidden width) and each layer's MLP channel group. An MLP the trace cannot express (a fused matrix split with
    ``chunk``, routed experts) gives a line saying it was not traced, not a disagreement."""
    view = ModelView(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # groups the trace cannot express are reported below instead
        traced = dependency_graph_groups(model, example_ids)
    lines: list[str] = []
    stream = _first_traced(traced, "hidden_feature", None)
    spec_stream = coupled_dims(hidden_feature_group(view))
    if stream is None:
        lines.append("residual stream: not traced")
    elif coupled_dims(stream) != spec_stream:
        only_spec = sorted(spec_stream - coupled_dims(stream))
        only_traced = sorted(coupled_dims(stream) - spec_stream)
        lines.append(f"residual stream: only in the spec {only_spec[:4]}, only in the trace {only_traced[:4]}")
    for layer in view.layers:
        if "gate" not in layer.roles and "up" not in layer.roles:
            continue
        found = _first_traced(traced, "mlp_channel", layer.index)
        if found is None:
            lines.append(f"layer {layer.index} MLP: not traced")
            continue
        spec_mlp = coupled_dims(mlp_channel_group(view, layer))
        if coupled_dims(found) != spec_mlp:
            lines.append(f"layer {layer.index} MLP: spec {sorted(spec_mlp)}, trace {sorted(coupled_dims(found))}")
    return lines


__all__ = ["coupled_dims", "trace_differences"]
