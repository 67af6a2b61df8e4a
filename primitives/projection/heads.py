"""SP3's MHA-intermediate projections on a model (Eqs. 10-12 fused at full width) and slicing heads to their own
widths (Eq. 15 with the masks).

Method note: docs/methods/sp3-attention-drone.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.head_widths import HeadWidths, head_width_refusal, with_head_widths
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.attention import attention_projection, project_attention_weights
from slimkit.primitives.projection.norms import set_param
from slimkit.primitives.projection.postnorm import Batch, input_grams


def gram_root(gram: torch.Tensor) -> torch.Tensor:
    """A square ``R`` with ``Rᵀ R = gram`` (symmetric PSD, float64): ``Λ^{1/2} Qᵀ`` from its eigenvectors."""
    values, vectors = torch.linalg.eigh(gram.double())
    return values.clamp_min(0).sqrt()[:, None] * vectors.T


def check_heads_projectable(model: nn.Module) -> ModelView:
    """The model's view, after refusing in one line a model whose heads cannot keep their own widths."""
    view = ModelView(model)
    reason = head_width_refusal(view.spec)
    if reason is not None:
        raise SlimkitError(f"MHA-intermediate projections and masks need an encoder's plain heads: {reason}")
    for layer in view.layers:
        if layer.attention_removed or layer.head_widths is not None or layer.num_kv_heads != layer.num_heads:
            raise SlimkitError(
                f"layer {layer.index}: MHA-intermediate projections need every layer's full heads (one KV head per "
                "query head, heads of one width)"
            )
    return view


def _augmented(linear: nn.Linear) -> torch.Tensor:
    """``[W, b]`` in float64 (a zero column without a bias): the weight acting on ``[x, 1]``."""
    weight = linear.weight.detach().double()
    bias = linear.bias.detach().double() if linear.bias is not None else weight.new_zeros(weight.shape[0])
    return torch.cat([weight, bias[:, None]], dim=1)


def project_heads(model: nn.Module, batches: Iterable[Batch], max_tokens: int | None = None) -> dict[str, Any]:
    """Fuse SP3's per-head projections (Eqs. 10-12) into every layer's q, k, v, o at full width, in place.

    ``batches``: calibration batches as :func:`~slimkit.primitives.projection.postnorm.input_grams` reads them;
    ``max_tokens`` caps the tokens per Gram matrix. Returns the tokens, and per layer the score energies ``Σ_Z``
    and value energies ``Σ_V`` of every head (``[heads][head_dim]``, descending: the order of the dimensions).
    """
    view = check_heads_projectable(model)
    paths = [view.path_of(layer.attention) for layer in view.layers]
    grams = input_grams(model, paths, batches, max_tokens, centre="none", with_ones=True)
    report: dict[str, Any] = {"tokens": grams[0].tokens, "sigma_qk": [], "sigma_v": []}
    with torch.no_grad():
        for layer, gram in zip(view.layers, grams, strict=True):
            q, k, v, o = (layer.linear(role) for role in ("q", "k", "v", "o"))
            root = gram_root(gram.gram)
            proj = attention_projection(
                root, _augmented(q), _augmented(k), _augmented(v), layer.num_heads, rope=layer.rope
            )
            fused = project_attention_weights(
                proj, q.weight, k.weight, v.weight, o.weight, b_q=q.bias, b_k=k.bias, b_v=v.bias
            )
            for module, role in ((q, "q"), (k, "k"), (v, "v"), (o, "o")):
                set_param(module, "weight", fused[f"w_{role}"])
                if role != "o" and module.bias is not None:
                    set_param(module, "bias", fused[f"b_{role}"])
            report["sigma_qk"].append(proj.sigma_qk.float().tolist())
            report["sigma_v"].append(proj.sigma_v.float().tolist())
    return report


def _rows(widths: Sequence[int], keep: Sequence[torch.Tensor]) -> torch.Tensor:
    """Packed row positions of the kept dimensions ``keep[h]`` (indices inside head ``h`` of width ``widths[h]``)."""
    offsets = [0]
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    return torch.cat([offset + k for offset, k in zip(offsets, keep, strict=True)]).long()


def _check_keep(name: str, keep: Sequence[torch.Tensor], widths: Sequence[int]) -> list[torch.Tensor]:
    if len(keep) != len(widths):
        raise SlimkitError(f"{name}: {len(widths)} heads need as many index sets, got {len(keep)}")
    out = []
    for h, (k, width) in enumerate(zip(keep, widths, strict=True)):
        k = torch.as_tensor(k, dtype=torch.long).flatten().cpu()
        if k.numel() and (bool((k[1:] <= k[:-1]).any()) or int(k.min()) < 0 or int(k.max()) >= width):
            raise SlimkitError(f"{name}[{h}] must be sorted distinct indices in [0, {width})")
        out.append(k)
    if sum(k.numel() for k in out) == 0:
        raise SlimkitError(f"{name}: every head would lose all its dimensions; keep at least one")
    return out


def slice_heads(
    model: nn.Module, layer_index: int, qk_keep: Sequence[torch.Tensor], vo_keep: Sequence[torch.Tensor]
) -> HeadWidths:
    """Keep q/k dimensions ``qk_keep[h]`` and v/o dimensions ``vo_keep[h]`` of each head of one layer, in place.

    Indices are inside each head (``0 .. width - 1``; the layer may already keep per-head widths); q and k lose the
    same rows, v its rows and o the matching columns. Returns the new widths.
    """
    view = ModelView(model)
    layer = view.layer(layer_index)
    if layer.attention_removed:
        raise SlimkitError(f"layer {layer_index}: its attention block was removed")
    current = layer.head_widths or HeadWidths((layer.head_dim,) * layer.num_heads, (layer.head_dim,) * layer.num_heads)
    qk = _check_keep("qk_keep", qk_keep, current.qk)
    vo = _check_keep("vo_keep", vo_keep, current.vo)
    q_rows, v_rows = _rows(current.qk, qk), _rows(current.vo, vo)
    with torch.no_grad():
        for role, rows in (("q", q_rows), ("k", q_rows), ("v", v_rows)):
            module = layer.linear(role)
            set_param(module, "weight", module.weight.detach()[rows.to(module.weight.device)])
            if module.bias is not None:
                set_param(module, "bias", module.bias.detach()[rows.to(module.bias.device)])
        o = layer.linear("o")
        set_param(o, "weight", o.weight.detach()[:, v_rows.to(o.weight.device)])
    widths = HeadWidths(tuple(int(k.numel()) for k in qk), tuple(int(k.numel()) for k in vo))
    projections = {role: layer.linear(role) for role in ("q", "k", "v")}
    new = with_head_widths(view.spec, layer.attention, widths, projections)
    layer.module.set_submodule(view.spec.attention, new)
    return widths


__all__ = ["check_heads_projectable", "gram_root", "project_heads", "slice_heads"]
