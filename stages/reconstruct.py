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
  states; see :mod:`slimkit.engine.layerwise`). "Dense" means the model as the block found it. With nothing
  compressed upstream (``X_d = X_c``) both targets give the same refit.

Kept columns are found by matching: removal slices whole columns without changing them, so every
column of the pruned projection equals one dense column (matched in order). A projection whose
columns were changed by another stage (a low-rank pair, a projection) is refused in one line. With
nothing removed the weight (and bias) is left as it is, with either target, and the report lists the layer under
``unchanged``; a layer whose sub-block was removed (``remove_blocks``) has no such projection and is listed under
``removed_block``. Roles given explicitly in ``roles`` of which none was refitted in any layer fail at the last layer
(the stage before reconstruct did not produce what it was asked to refit); when only some were not (LoRAP keeps v and
o dense at 20%), the report lists them under ``not_refitted`` and in its notes. The stage refuses to run first in its
``sequential`` block (there is then nothing removed to refit). At the top level of a recipe, after a model-scope stage
that removed units (``prune``, ``cce``), it runs its own layer-by-layer pass: each layer of the compressed model is
refitted against the same layer of the dense model, reloaded from the recipe's model source, on the compressed
model's calibration stream (:mod:`slimkit.stages.reconstruct_model`: what it costs and what it refuses).

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

from pydantic import Field

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.registry import register_stage
from slimkit.engine.stage_args import StageArgs
from slimkit.primitives.arch import LayerView
from slimkit.primitives.device.memory_model import FLOAT64, ModelShape
from slimkit.primitives.device.offload import is_offloaded
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.reconstruct.bias import bias_refusal
from slimkit.primitives.reconstruct.refit import READS, Consumer, RefitSettings, refit_role


class ReconstructArgs(RefitSettings, StageArgs):
    roles: list[Consumer] | None = Field(default=None, min_length=1)
    """Projections to refit: down (reads the MLP channels) and o (reads the attention heads) after units were
    removed, and any role (q, k, v, o, gate, up, down) that an earlier stage made a low-rank pair (its left factor
    is refitted). Unset: down and o, each in the layers where it lost inputs or is low-rank. Given: the run fails
    when none was refitted in any layer, and the report names the ones that were not."""

    @property
    def consumers(self) -> list[Consumer]:
        """The roles to refit (both when ``roles`` is unset)."""
        return list(self.roles) if self.roles is not None else ["down", "o"]

    def needs_calibration(self) -> bool:
        return True

    def reloads_dense(self) -> bool:
        return True  # at the top level: its refit target

    def block_matrix_bytes(self, shape: ModelShape) -> int:
        return consumer_solve_bytes(shape)

    def layer_grams(self) -> frozenset[str]:
        return frozenset(self.consumers)

    def refits(self) -> frozenset[str]:
        return frozenset(self.consumers)

    def dense_targets(self) -> frozenset[str]:
        return frozenset(self.consumers) if self.target == "dense" else frozenset()


def consumer_solve_bytes(shape: ModelShape) -> int:
    """A consumer's float64 input Gram, its kept block, the damped copy, the Cholesky factor and the solve's
    temporaries: about five d x d float64 matrices at once, d the wider of hidden and intermediate."""
    widest = max(shape.hidden, shape.intermediate)
    return 5 * widest * widest * FLOAT64


def _check_placement(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: LayerStats) -> None:
    """Refusals before the first refit of a block: outside ``sequential``, first in its block, or a bias the
    architecture cannot carry."""
    block = stats.block
    if stats.dense_consumers is None or block is None or block.propagate != "compressed":
        raise SlimkitError("reconstruct runs inside sequential, after the stage that removes units")
    if not block.earlier:
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
    paper="least-squares reconstruction of the kept inputs (as in SlimGPT / ZipLM / FLAP's refits); FLAP's bias "
    "compensation (bias: mean)",
    top_level=lambda ctx, args, index: _top_level(ctx, args, index),
)
def reconstruct(ctx: Context, args: ReconstructArgs, layer: LayerView, stats: LayerStats) -> None:
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
        if role not in layer.roles:  # its sub-block was removed (remove_blocks): nothing reads the removed units
            entry.setdefault("removed_block", {}).setdefault(role, []).append(layer.index)
            continue
        result = refit_role(layer, role, stats.consumer(role), args, ctx.model, ctx.view)
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
        check_roles_acted(ctx, args.roles, entry)


def check_roles_acted(ctx: Context, roles: list[Consumer], entry: dict) -> None:
    """After the last layer: fail when none of the roles asked for was refitted in any layer (the stage before
    produced nothing to refit); flag in the report (``not_refitted`` and a note) the ones that were not, when
    others were (e.g. ``[q, k, v, o, down]`` after LoRAP, whose allocation keeps v and o dense at some ratios)."""
    missing = [role for role in roles if role not in entry["layers"]]
    if not missing:
        return
    if len(missing) == len(roles):
        raise SlimkitError(
            f"reconstruct: roles asks to refit {', '.join(missing)}, but no stage before it removed the units "
            f"{' or '.join(READS.get(r, f'{r} reads') for r in missing)} in any layer"
            + ("" if set(missing) <= set(READS) else " or made them low-rank (q, k, v, gate, up: low-rank only)")
        )
    entry["not_refitted"] = missing
    ctx.notes.append(
        f"reconstruct: {', '.join(missing)} refitted in no layer (no units removed from their inputs and not "
        f"low-rank); refitted: {', '.join(r for r in roles if r in entry['layers'])}"
    )


def _top_level(ctx: Context, args: ReconstructArgs, index: int) -> None:
    """``reconstruct`` at the top level of a recipe (``stages.<index>``): the whole-model form."""
    from slimkit.stages.reconstruct_model import reconstruct_top_level  # it imports this module

    reconstruct_top_level(ctx, args, index)
