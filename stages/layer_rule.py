"""LoRAP's layer ratio (Appendix C.1) as the stages read it: what is left of the recipe's target when a block starts,
spread evenly over every layer's attention and MLP parameters. A stage with no explicit ratio whose ``ratio_rule``
is ``layer`` (``prune_layer``, ``obs_prune_layer``, ``prune``) or ``lowrank`` without ``ratio`` takes this share.

The rule is defined for a target of the whole model or of the layers (what is left of it, over the layers' weights);
of the MLP or the attention alone it is not (the layers' weights are both), so such a recipe is refused when it is
validated, naming the argument to set.

Method note: docs/methods/lorap-awsvd.md.
"""

from __future__ import annotations

from slimkit.engine.context import Context
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.schema import Recipe

RULE_PARTS = ("model", "layers")
"""The targets the layer rule spreads over the layers."""


def check_layer_rule(recipe: Recipe, where: str) -> None:
    """Refuse (a validation ``ValueError`` starting with ``where``) a layer-rule share under a target it is not
    defined for."""
    of = recipe.target.of
    if of not in RULE_PARTS:
        raise ValueError(
            f"{where}: its share is LoRAP's layer ratio (no ratio given), which spreads what is left of a target of "
            f"the model or the layers over every layer's attention and MLP, and target.of is {of}; set target.of: "
            "model or layers, or give the stage an explicit ratio (args.ratio)"
        )


def layer_rule_ratio(ctx: Context) -> float:
    """``Ratio_l = left / (layers x Param_layer)``, with ``left`` what is left of the target's part when the block
    started (``Param_total x Ratio_s`` on a dense model with ``target.of: model``) and ``Param_layer`` one layer's
    attention and MLP parameters at that time (averaged over the layers)."""
    target = ctx.recipe.target
    if target.of not in RULE_PARTS:
        raise SlimkitError(f"ratio_rule: layer needs target.of: model or layers (got {target.of})")
    start = ctx.block_params()
    layers = ctx.view.num_layers
    layer_params = (start["attention"] + start["mlp"]) // layers
    left = max(0.0, start[target.part] - (1.0 - target.ratio) * ctx.params_before[target.part])
    ratio = left / (layers * layer_params)
    if ratio >= 1.0:
        raise SlimkitError(
            f"ratio_rule: layer: the layers would have to lose {ratio:.1%} of their parameters to meet the target"
        )
    return ratio


__all__ = ["RULE_PARTS", "check_layer_rule", "layer_rule_ratio"]
