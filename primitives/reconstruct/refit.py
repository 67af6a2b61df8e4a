"""Refitting one consumer projection of a layer after an earlier stage removed some of its inputs or made it a
low-rank pair: the maths behind the ``reconstruct`` stage (:mod:`slimkit.stages.reconstruct` tells the
choices and the measurements).

* :class:`RefitSettings`: the ridge, the target and whether weights and bias move.
* :func:`matched_columns`: the kept input columns, found by matching the pruned weight against the dense one.
* :func:`refit_role`: the refit of one role (weights by least squares, bias jointly with ``bias: mean``, a low-rank
  pair's left factor by :func:`refit_lowrank_left`), with the relative output error before and after.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import field_validator, model_validator

from slimkit.primitives.arch import LayerView, ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import LowRankLinear
from slimkit.primitives.reconstruct.bias import consumer_bias
from slimkit.primitives.reconstruct.consumer import DenseConsumer
from slimkit.primitives.reconstruct.error import embed_columns, output_energy, output_error
from slimkit.primitives.reconstruct.gram import with_bias_column
from slimkit.primitives.reconstruct.least_squares import AffineRefit, refit_affine, refit_least_squares, refit_to_dense
from slimkit.primitives.reconstruct.lowrank_refit import refit_left
from slimkit.primitives.settings import Strict

MIN_DAMPING = 1e-12


class RefitSettings(Strict):
    """How a consumer is refitted: the ridge (``damping``, ``toward``), what it matches (``target``) and whether the
    weights and the bias move (``refit``, ``bias``)."""

    damping: float = 0.1
    """Ridge damping as a fraction of the mean diagonal of the kept inputs' Gram matrix (at least 1e-12: a zero
    damping leaves a rank-deficient Gram unsolvable)."""
    refit: bool = True
    """Refit the kept columns by least squares; false keeps the weights (then only ``bias: mean`` acts)."""
    bias: Literal["none", "mean"] = "none"
    """mean: move the consumer's bias too (FLAP's mean compensation; jointly with the refit when ``refit``)."""
    target: Literal["compressed", "dense"] = "compressed"
    """What the refit matches: the dense layer's output on the inputs the compressed predecessors give it
    (compressed) or the dense model's output on the same tokens (dense: a second activation stream)."""
    toward: Literal["zero", "kept"] = "kept"
    """What the ridge pulls towards: the pruned weight's own kept columns (a large damping then leaves the pruned
    weight as it was) or zero (plain ridge). Measured on smollm2 at 20% (benchmarks/results/2026-11-23-reconstruct.md):
    the plain refit (zero, 1e-6) over-fits 4,096 calibration tokens for down_proj; kept with 0.1 did best."""

    @field_validator("damping")
    @classmethod
    def _positive_damping(cls, value: float) -> float:
        if value < MIN_DAMPING:
            raise ValueError(
                f"must be at least {MIN_DAMPING:g} (a positive ridge keeps the refit solvable), got {value:g}"
            )
        return value

    @model_validator(mode="after")
    def _something_to_do(self) -> RefitSettings:
        if not self.refit and self.bias == "none":
            raise ValueError("refit: false with bias: none changes nothing; set bias: mean or refit: true")
        return self


READS = {"down": "down reads (MLP channels)", "o": "o reads (attention heads)"}
"""The roles that read removable units; the others are refitted only as low-rank pairs."""


def matched_columns(dense: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor | None:
    """Indices ``K`` (ascending) with ``pruned == dense[:, K]`` exactly, or None when the columns do not match."""
    if pruned.shape[0] != dense.shape[0] or pruned.shape[1] > dense.shape[1]:
        return None
    kept = []
    position = 0
    for column in range(pruned.shape[1]):
        target = pruned[:, column]
        while position < dense.shape[1] and not torch.equal(dense[:, position], target):
            position += 1
        if position == dense.shape[1]:
            return None
        kept.append(position)
        position += 1
    return torch.tensor(kept, dtype=torch.long)


def refit_role(
    layer: LayerView,
    role: LinearRole,
    snapshot: DenseConsumer,
    args: RefitSettings,
    model: torch.nn.Module | None = None,
    view: ModelView | None = None,
) -> dict | None:
    """Refit ``layer``'s ``role`` projection against ``snapshot`` (the dense projection and its input statistics),
    and shift its bias with ``args.bias == "mean"`` (``model`` and ``view`` give the bias); its report entry, or None
    when nothing was removed from its inputs."""
    module = layer.linear(role)
    if isinstance(module, LowRankLinear):
        return refit_lowrank_left(layer, role, module, snapshot, args)
    weight = module.weight.detach()
    if weight.shape == snapshot.weight.shape or role not in READS:
        return None  # nothing removed from its inputs (q, k, v, gate and up read the hidden stream, never pruned)
    kept = matched_columns(snapshot.weight.to(weight.device), weight)
    if kept is None:
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}'s columns are not a subset of its dense columns (a stage "
            "changed them, not only removed some); put reconstruct right after the stage that removes units"
        )
    width = snapshot.weight.shape[1]
    dense_target = args.target == "dense"
    if dense_target and snapshot.cross is None:
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}: target dense, but the block passed no dense stream"
        )
    tokens = snapshot.tokens
    input_sum = snapshot.input_sum if snapshot.input_sum is not None else torch.zeros(width, dtype=torch.float64)
    energy = output_energy(snapshot.weight, snapshot.gram)
    before = output_error(snapshot.weight, embed_columns(weight, kept, width), snapshot.gram, True, energy)
    try:
        fitted = (
            refit_affine(
                snapshot.weight,
                snapshot.gram,
                input_sum,
                max(tokens, 1),
                kept,
                cross=snapshot.cross if dense_target else None,
                target_sum=snapshot.dense_sum if dense_target else None,
                refit=args.refit,
                damping=args.damping,
                toward_kept=args.toward == "kept",
            )
            if args.bias == "mean"
            else refit_weights_only(snapshot, kept, args)
        )
    except ValueError as error:  # a non-finite Gram or cross term (NaN/inf activations)
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}: cannot refit ({error}); no damping (damping: {args.damping:g}) "
            "makes that solvable: check the model and calibration data for NaN/inf activations"
        ) from None
    if not (torch.isfinite(fitted.weight).all() and torch.isfinite(fitted.bias_shift).all()):
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}: the refit is not finite with damping {fitted.info.damping:g} "
            "(the Gram matrix of its inputs is singular beyond what damping fixes); raise damping"
        )
    with torch.no_grad():
        module.weight.copy_(fitted.weight.to(device=weight.device, dtype=weight.dtype))
        if args.bias == "mean":
            bias = consumer_bias(model, view, layer, role)
            bias.add_(fitted.bias_shift.to(device=bias.device, dtype=bias.dtype))
    after_weight = embed_columns(module.weight, kept, width)
    shift = fitted.bias_shift if args.bias == "mean" else None
    result = {
        "kept": int(kept.numel()),
        "of": int(width),
        "error_before": before,
        "error_after": affine_error(snapshot, after_weight, shift)
        if shift is not None and tokens
        else output_error(snapshot.weight, after_weight, snapshot.gram, True, energy),
        "damping": fitted.info.damping,
        "method": fitted.info.method,
    }
    if shift is not None and tokens:
        mean_output = snapshot.weight.double() @ (input_sum.to(snapshot.weight.device) / tokens)
        result["bias_shift"] = float(shift.double().norm() / mean_output.norm().clamp_min(1e-30))
    return result


def refit_lowrank_left(
    layer: LayerView, role: str, module: LowRankLinear, snapshot: DenseConsumer, args: RefitSettings
) -> dict:
    """Refit the left factor ``L`` of a low-rank pair with its ``R`` fixed, ``L' = W G Rᵀ (R G Rᵀ + λI)⁻¹``
    (:func:`~slimkit.primitives.reconstruct.refit_left`; with ``toward: kept`` the ridge pulls towards the current
    ``L``; with ``target: dense`` ``G`` becomes the cross term ``C``), against the dense weight ``W`` on the layer's
    calibration inputs. The report entry gives the relative output error ``||(W − L R) X||² / ||W X||²`` before and
    after."""
    if args.bias == "mean":
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role} is a low-rank pair and bias: mean compensates removed inputs "
            "only; leave low-rank roles out of roles or use bias: none"
        )
    if args.target == "dense" and snapshot.cross is None:
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}: target dense, but the block passed no dense stream"
        )
    left, right = module.second.weight, module.first.weight
    energy = output_energy(snapshot.weight, snapshot.gram)
    before = output_error(snapshot.weight, left.double() @ right.double(), snapshot.gram, True, energy)
    fitted = refit_left(
        snapshot.weight,
        right,
        snapshot.gram,
        cross=snapshot.cross if args.target == "dense" else None,
        damping=args.damping,
        toward=left if args.toward == "kept" else None,
    )
    if not torch.isfinite(fitted.weight).all():
        raise SlimkitError(
            f"reconstruct: layer {layer.index} {role}: the refit is not finite with damping {fitted.info.damping:g}; "
            "check the calibration data for NaN/inf activations or raise damping"
        )
    with torch.no_grad():
        left.copy_(fitted.weight.to(device=left.device, dtype=left.dtype))
    after = output_error(snapshot.weight, left.double() @ right.double(), snapshot.gram, True, energy)
    return {
        "rank": module.rank,
        "of": int(min(snapshot.weight.shape)),
        "error_before": before,
        "error_after": after,
        "damping": fitted.info.damping,
        "method": fitted.info.method,
    }


def refit_weights_only(snapshot: DenseConsumer, kept: torch.Tensor, args: RefitSettings) -> AffineRefit:
    """The weight refit without a bias (``bias: none``), as an :class:`AffineRefit` with a zero shift."""
    toward_kept = args.toward == "kept"
    if args.target == "dense":
        refit = refit_to_dense(
            snapshot.weight, snapshot.cross, snapshot.gram, kept, damping=args.damping, toward_kept=toward_kept
        )
    else:
        refit = refit_least_squares(snapshot.weight, snapshot.gram, kept, damping=args.damping, toward_kept=toward_kept)
    return AffineRefit(refit.weight, torch.zeros(refit.weight.shape[0], dtype=refit.weight.dtype), refit.info)


def affine_error(snapshot: DenseConsumer, approx: torch.Tensor, shift: torch.Tensor) -> float:
    """Relative ``||W X − (Ŵ X + Δb)||² / ||W X||²`` on the augmented Gram ``[[G, s], [sᵀ, T]]``."""
    augmented = with_bias_column(snapshot.gram, snapshot.input_sum, snapshot.tokens)
    weight = snapshot.weight.double()
    dense = torch.cat([weight, weight.new_zeros(weight.shape[0], 1)], dim=1)
    fitted = torch.cat([approx.detach().double().to(weight.device), shift.double().to(weight.device)[:, None]], dim=1)
    return output_error(dense, fitted, augmented, relative=True)


__all__ = [
    "MIN_DAMPING",
    "READS",
    "RefitSettings",
    "affine_error",
    "matched_columns",
    "refit_lowrank_left",
    "refit_role",
    "refit_weights_only",
]
