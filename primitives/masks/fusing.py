"""Fusing trained SP3 masks into the weights of a pre-norm decoder (SP3 §3.3, Eqs. 15–18; Appendix F).

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.masks.mask_set import HIDDEN_FIELDS, MaskShape, MaskValues
from slimkit.primitives.masks.sparsity import stream_model_size
from slimkit.primitives.projection.adapters import NAME as BASIS_CHANGE
from slimkit.primitives.projection.norms import linear_param, set_param
from slimkit.primitives.projection.slice import slice_stream, stream_groups
from slimkit.primitives.surgery import prune_layer

SUPPORTED = frozenset({*HIDDEN_FIELDS, "f"})


def _fold_filters(model: nn.Module, values: list[torch.Tensor]) -> list[int]:
    """``W_down[:, j] *= z_f[j]``, then remove the filters with ``z_f = 0``; returns the new widths."""
    view = ModelView(model)
    widths = []
    with torch.no_grad():
        for i, z in enumerate(values):
            down = view.layer(i).linear("down")
            owner, name = linear_param(down, "weight", 1)
            weight = getattr(owner, name).detach()
            set_param(owner, name, weight.double() * z.to(weight.device, torch.float64)[None, :])
            keep = (z != 0).nonzero().flatten().cpu()  # a small index list; surgery indexes on the CPU
            if keep.numel() == 0:
                raise SlimkitError(f"layer {i}: every FFN filter is masked; keep at least one")
            if keep.numel() < z.numel():
                prune_layer(model, "mlp_channel", i, keep)
            widths.append(int(keep.numel()))
    return widths


def _group_values(values: MaskValues, groups: Sequence[range]) -> list[torch.Tensor] | None:
    hidden = [getattr(values, name) for name in HIDDEN_FIELDS]
    if all(h is None for h in hidden):
        return None
    if any(h is None for h in hidden):
        raise SlimkitError("stream masks need all four hidden fields (one gate per group)")
    out = []
    for group in groups:
        first = hidden[0][group[0]]
        for field in hidden:
            for i in group:
                if not torch.equal(field[i], first):
                    raise SlimkitError(f"layer {i}: hidden masks differ inside a layer group; use one gate per group")
        out.append(first.detach())
    return out


def stream_count_args(model: nn.Module) -> dict:
    """Keyword arguments of :func:`~.sparsity.stream_model_size` for ``model`` (``groups`` included).

    ``fixed`` is whatever the masks do not touch (biases of an untied head, ...), set so that the
    count without masks equals the model's parameter count; the count of 0/1 masks then equals the
    fused model's (tested).
    """
    view = ModelView(model)
    rows = view.embed_tokens.weight.shape[0]
    rows += sum(view.base.get_submodule(p).weight.shape[0] for p in view.spec.extra_embeddings)
    final = view.final_norm.module if view.final_norm is not None else None
    args = {
        "groups": stream_groups(model),
        "embedding_rows": rows,
        "head_rows": 0 if view.tied or view.head is None else view.head.weight.shape[0],
        "head_map": final is not None and BASIS_CHANGE in final._modules,
        "embedding_map": BASIS_CHANGE in view.embed_tokens._modules,
        "include_bias": True,
        "boundaries": [  # Eq. 34 group boundaries: the down projection writes the next group's stream
            i
            for i in range(view.num_layers)
            if getattr(view.layer(i).module._modules.get(BASIS_CHANGE), "hook", None) == "branch"
        ],
    }
    unmasked = stream_model_size(MaskValues(), MaskShape.from_view(view), **args)
    args["fixed"] = view.num_params() - round(float(unmasked))
    return args


def fuse_stream_masks(model: nn.Module, values: MaskValues) -> dict:
    """Fold final mask values into ``model`` and remove what they zero (see the module docstring); in place."""
    unsupported = set(values.present()) - SUPPORTED
    if unsupported:
        raise SlimkitError(
            f"fusing masks {sorted(unsupported)} into a pre-norm decoder is not supported; "
            "SP3's LLM setting trains hidden and FFN-filter masks only (Appendix F)"
        )
    groups = stream_groups(model)
    report: dict = {"groups": [[g[0], g[-1]] for g in groups]}
    hidden = _group_values(values, groups)
    if values.f is not None:
        report["ffn_widths"] = _fold_filters(model, [z.detach() for z in values.f])
    if hidden is not None:
        keep = [(z != 0).nonzero().flatten().cpu() for z in hidden]
        report.update(slice_stream(model, keep, scale=hidden))
    return report


__all__ = ["fuse_stream_masks", "stream_count_args"]
