"""Reconstruction stage: refit a layer's consumer projections after units were removed (issue #17).

Inside ``sequential``, after a stage that removed units of a layer (``prune_layer`` with any scorer,
for MLP channels or attention heads), ``reconstruct`` refits the projections that *read* the removed
units, ``down_proj`` for MLP channels and ``o_proj`` for heads, so the layer's output on the
calibration inputs matches the dense layer's:

    W' = argmin ||W X - W' X_K||^2 + lambda ||W'||^2 = W G[:, K] (G[K, K] + lambda I)^-1

with ``G = X X^T`` the Gram matrix of the projection's dense inputs, accumulated (float64) in the
block's statistics pass before any stage changed the layer, ``K`` the kept input columns and
``lambda = damping x mean(diag G[K, K])`` (:func:`slimkit.primitives.reconstruct.refit_least_squares`).
By default the ridge pulls towards the pruned weight's own kept columns (``toward: kept``,
``||W' - W[:, K]||^2``), not towards zero: the plain refit over-fits a few thousand calibration tokens
(down_proj has 1,100-1,500 inputs on smollm2), and shrinking towards zero hurts more (measured).

A projection that an earlier stage of the block made a low-rank pair (``lowrank``: LoRAP's attention) gets its left
factor refitted with the right one fixed, ``L' = W G Rᵀ (R G Rᵀ + λI)⁻¹`` against the dense weight on the same
inputs (:func:`slimkit.primitives.reconstruct.refit_left`, the "refit the second factor" of issue #17); name it in
``roles`` (q, k, v, gate and up are refitted only that way). After ``lowrank`` with ``method: whiten`` the pair already
minimises that error, so the refit changes almost nothing there.

Options (issue #17):

* ``bias: mean`` also moves the consumer's bias. Without a refit (``refit: false``) that is FLAP's baseline, the
  removed inputs replaced by their calibration mean, ``Δb = W[:, S] x̄_S``. With the refit (the default) weights
  and bias are fitted *jointly*: ``b`` is free and the ridge acts on ``W'`` only, which is the refit on centred
  statistics ``G - s sᵀ/T`` followed by ``Δb = W x̄ - W' x̄_K`` (:func:`~slimkit.primitives.reconstruct.refit_affine`;
  the same as the augmented Gram of ``with_bias_column`` with an undamped bias column). Chosen over "refit, then
  add FLAP's Δb": that sum is not a least-squares solution (the refit has already absorbed part of the mean),
  while the joint fit is never worse on the calibration objective. Llama's ``down_proj``/``o_proj`` have no bias:
  the stage sets the global config flag (``mlp_bias`` / ``attention_bias``) and gives every projection it covers,
  in every layer, a zero bias (:func:`~slimkit.primitives.reconstruct.consumer_bias`), so the saved model loads in
  stock transformers. A consumer that already has a bias (OPT with ``enable_bias``, BERT) just gets ``Δb`` added.
  Architectures with no flag for the consumer (Mistral; Qwen2 and Qwen3's ``down``) are refused in one line when
  the stage first runs (a recipe does not know its model's architecture before it is loaded).
* ``target: dense`` fits the dense model's output on the same tokens instead of the dense layer's output on what
  the compressed predecessors feed it: ``W' = argmin ||W X_d - W' X_c,K||^2`` with ``X_d`` the dense model's
  input of the consumer (:func:`~slimkit.primitives.reconstruct.refit_to_dense`, cross term ``C = X_d X_cᵀ``). The
  block then carries a second activation stream through the dense layers (one more set of calibration hidden
  states; see :mod:`slimkit.recipes.layerwise`). "Dense" means the model as the block found it. With nothing
  compressed upstream (``X_d = X_c``) both targets give the same refit.

Kept columns are found by matching: removal slices whole columns without changing them, so every
column of the pruned projection equals one dense column (matched in order). A projection whose
columns were changed by another stage (a low-rank pair, a projection) is refused in one line. With
nothing removed the weight (and bias) is left as it is, with either target, and the report lists the layer under
``unchanged``. Roles given explicitly in ``roles`` of which none was refitted in any layer fail at the last layer
(the stage before reconstruct did not produce what it was asked to refit); when only some were not (LoRAP keeps v and
o dense at 20%), the report lists them under ``not_refitted`` and in its notes. The stage refuses to run first in its
``sequential`` block (there is then nothing removed to refit). At the top level of a recipe, after a model-scope stage
that removed units (``prune``, ``cce``), it runs its own layer-by-layer pass: each layer of the compressed model is
refitted against the same layer of the dense model, reloaded from the recipe's model source, on the compressed
model's calibration stream (:mod:`slimkit.recipes.stages.reconstruct_model`: what it costs and what it refuses).

Bad input: ``damping`` must be at least 1e-12 (0, negative or NaN values are refused when the recipe is read: the
damping is what keeps a rank-deficient ``G[K, K]`` solvable, and below ~1e-12 it vanishes in float64 next to
``mean(diag G)``). A Gram matrix no damping can make solvable (non-finite entries: NaN/inf activations) fails in
one line naming the layer, the role and ``damping``.

The report gives, per role, the relative output error ``tr(dW G dW^T) / tr(W G W^T)`` of the pruned projection
before and after the refit, always against ``W X_c`` (the dense layer on the inputs it receives; with a bias shift
through the augmented Gram), so with ``target: dense`` "after" can be above "before" by design, and the norm of
the bias shift relative to the norm of ``W x̄``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from slimkit.primitives.arch import LayerView
from slimkit.primitives.device.offload import is_offloaded
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank.module import LowRankLinear
from slimkit.primitives.reconstruct import (
    AffineRefit,
    bias_refusal,
    consumer_bias,
    embed_columns,
    output_energy,
    output_error,
    refit_affine,
    refit_least_squares,
    refit_left,
    refit_to_dense,
    with_bias_column,
)
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict

Consumer = Literal["q", "k", "v", "o", "gate", "up", "down"]
MIN_DAMPING = 1e-12


class ReconstructArgs(Strict):
    roles: list[Consumer] | None = Field(default=None, min_length=1)
    """Projections to refit: down (reads the MLP channels) and o (reads the attention heads) after units were
    removed, and any role (q, k, v, o, gate, up, down) that an earlier stage made a low-rank pair (its left factor
    is refitted). Unset: down and o, each in the layers where it lost inputs or is low-rank. Given: the run fails
    when none was refitted in any layer, and the report names the ones that were not."""
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

    @property
    def consumers(self) -> list[Consumer]:
        """The roles to refit (both when ``roles`` is unset)."""
        return list(self.roles) if self.roles is not None else ["down", "o"]

    @field_validator("damping")
    @classmethod
    def _positive_damping(cls, value: float) -> float:
        if value < MIN_DAMPING:
            raise ValueError(
                f"must be at least {MIN_DAMPING:g} (a positive ridge keeps the refit solvable), got {value:g}"
            )
        return value

    @model_validator(mode="after")
    def _something_to_do(self) -> ReconstructArgs:
        if not self.refit and self.bias == "none":
            raise ValueError("refit: false with bias: none changes nothing; set bias: mean or refit: true")
        return self


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


def _refit_role(
    layer: LayerView,
    role: Consumer,
    stats: dict,
    damping: float,
    toward: str = "zero",
    *,
    args: ReconstructArgs | None = None,
    model: torch.nn.Module | None = None,
    view: object | None = None,
) -> dict | None:
    """Refit ``layer``'s ``role`` projection (and shift its bias with ``args.bias == "mean"``); its report entry, or
    None when nothing was removed from its inputs."""
    args = args or ReconstructArgs(damping=damping, toward=toward)
    module = layer.linear(role)
    snapshot = stats["dense_consumers"][role]
    if isinstance(module, LowRankLinear):
        return _refit_lowrank(layer, role, module, snapshot, args)
    weight = module.weight.detach()
    if weight.shape == snapshot.weight.shape or role not in _READS:
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
            else _weights_only(snapshot, kept, args)
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
        "error_after": _affine_error(snapshot, after_weight, shift)
        if shift is not None and tokens
        else output_error(snapshot.weight, after_weight, snapshot.gram, True, energy),
        "damping": fitted.info.damping,
        "method": fitted.info.method,
    }
    if shift is not None and tokens:
        mean_output = snapshot.weight.double() @ (input_sum.to(snapshot.weight.device) / tokens)
        result["bias_shift"] = float(shift.double().norm() / mean_output.norm().clamp_min(1e-30))
    return result


def _refit_lowrank(layer: LayerView, role: str, module: LowRankLinear, snapshot, args: ReconstructArgs) -> dict:
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


def _weights_only(snapshot, kept: torch.Tensor, args: ReconstructArgs):
    """The weight refit without a bias (``bias: none``), as an :class:`AffineRefit` with a zero shift."""
    toward_kept = args.toward == "kept"
    if args.target == "dense":
        refit = refit_to_dense(
            snapshot.weight, snapshot.cross, snapshot.gram, kept, damping=args.damping, toward_kept=toward_kept
        )
    else:
        refit = refit_least_squares(snapshot.weight, snapshot.gram, kept, damping=args.damping, toward_kept=toward_kept)
    return AffineRefit(refit.weight, torch.zeros(refit.weight.shape[0], dtype=refit.weight.dtype), refit.info)


def _affine_error(snapshot, approx: torch.Tensor, shift: torch.Tensor) -> float:
    """Relative ``||W X − (Ŵ X + Δb)||² / ||W X||²`` on the augmented Gram ``[[G, s], [sᵀ, T]]``."""
    augmented = with_bias_column(snapshot.gram, snapshot.input_sum, snapshot.tokens)
    weight = snapshot.weight.double()
    dense = torch.cat([weight, weight.new_zeros(weight.shape[0], 1)], dim=1)
    fitted = torch.cat([approx.detach().double().to(weight.device), shift.double().to(weight.device)[:, None]], dim=1)
    return output_error(dense, fitted, augmented, relative=True)


def _check_placement(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: dict) -> None:
    """Refusals before the first refit of a block: outside ``sequential``, first in its block, or a bias the
    architecture cannot carry."""
    block = stats.get("block", {})
    if "dense_consumers" not in stats or block.get("propagate") != "compressed":
        raise SlimkitError("reconstruct runs inside sequential, after the stage that removes units")
    if not block.get("earlier"):
        raise SlimkitError(
            "reconstruct is the first stage of its sequential block, so nothing was removed to refit; put it right "
            "after the stage that removes units (prune_layer)"
        )
    check_bias(ctx, args, layer)


def check_bias(ctx: Context, args: ReconstructArgs, layer: LayerView) -> None:
    """Refuse ``bias: mean`` on a consumer the architecture or an offloaded model cannot give a bias."""
    if args.bias != "mean":
        return
    for role in args.consumers:
        reason = bias_refusal(ctx.model, layer, role)
        if reason is not None:
            raise SlimkitError(f"reconstruct: bias: mean needs a bias on {role}, but {reason}")
        if layer.linear(role).bias is None and is_offloaded(ctx.model):
            raise SlimkitError(
                f"reconstruct: bias: mean would add biases to every layer's {role} family, which an offloaded model "
                "(model.max_memory) cannot take; leave max_memory unset or use bias: none"
            )


@register_stage(
    "reconstruct",
    args=ReconstructArgs,
    scope="layer",
    needs_calibration=lambda _args: True,
    paper="least-squares reconstruction of the kept inputs (as in SlimGPT / ZipLM / FLAP's refits); FLAP's bias "
    "compensation (bias: mean)",
    layer_grams=lambda args: frozenset(args.consumers),
    dense_targets=lambda args: frozenset(args.consumers) if args.target == "dense" else frozenset(),
    top_level=lambda ctx, args, index: _top_level(ctx, args, index),
)
def reconstruct(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: dict) -> None:
    """Refit down_proj / o_proj from the kept inputs so the layer's output matches the dense layer's."""
    # One report per block, updated layer by layer (the block cache lives as long as the block).
    if "reconstruct:report" not in ctx.block_cache:
        _check_placement(ctx, args, layer, stats)
        settings = {"bias": args.bias, "target": args.target, "refit": args.refit}
        ctx.block_cache["reconstruct:report"] = ctx.report_stage(
            "reconstruct", {"settings": settings, "roles": {}, "layers": {}, "unchanged": {}}
        )
    entry = ctx.stage_report[ctx.block_cache["reconstruct:report"]]
    for role in args.consumers:
        result = _refit_role(layer, role, stats, args.damping, args.toward, args=args, model=ctx.model, view=ctx.view)
        if result is not None:
            entry["layers"].setdefault(role, {})[str(layer.index)] = result
        else:
            entry["unchanged"].setdefault(role, []).append(layer.index)
    for role, per_layer in entry["layers"].items():
        entry["roles"][role] = {
            "layers": len(per_layer),
            "mean_error_before": sum(r["error_before"] for r in per_layer.values()) / len(per_layer),
            "mean_error_after": sum(r["error_after"] for r in per_layer.values()) / len(per_layer),
        }
    if layer.index == len(ctx.view.layers) - 1 and args.roles is not None:
        _check_roles_acted(ctx, args.roles, entry)


def _check_roles_acted(ctx: Context, roles: list[Consumer], entry: dict) -> None:
    """After the last layer: fail when none of the roles asked for was refitted in any layer (the stage before
    produced nothing to refit); flag in the report (``not_refitted`` and a note) the ones that were not, when
    others were (e.g. ``[q, k, v, o, down]`` after LoRAP, whose allocation keeps v and o dense at some ratios)."""
    missing = [role for role in roles if role not in entry["layers"]]
    if not missing:
        return
    if len(missing) == len(roles):
        raise SlimkitError(
            f"reconstruct: roles asks to refit {', '.join(missing)}, but no stage before it removed the units "
            f"{' or '.join(_READS.get(r, f'{r} reads') for r in missing)} in any layer"
            + ("" if set(missing) <= set(_READS) else " or made them low-rank (q, k, v, gate, up: low-rank only)")
        )
    entry["not_refitted"] = missing
    ctx.notes.append(
        f"reconstruct: {', '.join(missing)} refitted in no layer (no units removed from their inputs and not "
        f"low-rank); refitted: {', '.join(r for r in roles if r in entry['layers'])}"
    )


_READS = {"down": "down reads (MLP channels)", "o": "o reads (attention heads)"}
"""The roles that read removable units; the others are refitted only as low-rank pairs."""


def _top_level(ctx: Context, args: ReconstructArgs, index: int) -> None:
    """``reconstruct`` at the top level of a recipe (``stages.<index>``): the whole-model form."""
    from slimkit.recipes.stages.reconstruct_model import reconstruct_top_level  # it imports this module

    reconstruct_top_level(ctx, args, index)
