"""``prunenet`` (model scope): calibration-free MLP channel pruning with a learned policy.

PruneNet (Sengupta et al., ICLR 2025; ../shared/papers/prunenet-policy-learning.md): one policy
learner scores the rows of every layer's FFN1 from the weights alone (Eq. 3), trained with
REINFORCE on the Kolmogorov-Smirnov distance between the singular values of the original and the
compressed FFN1 (Eqs. 6-7, Algorithm 1); the kept rows of FFN1 (and the gate) and the same columns
of FFN2 are then removed with the MLP-channel group. No calibration data is read.

The removal ratio of each layer's channels follows the recipe target (``of: mlp`` directly; ``of:
model`` or ``layers`` solved on exact parameter counts), or ``ratio``; ``schedule: linear`` spreads
it over the layers with the same mean (Table 7). ``policy: DIR`` loads a saved policy and skips
training (Table 6: one policy reused across ratios); the trained policy is saved with the run as
``OUT/policy/`` unless ``save_policy: false``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from slimkit.primitives.groups import build_groups
from slimkit.primitives.optim.policy import (
    PruneNetPolicy,
    ffn_weights,
    layer_ratios,
    load_policy,
    policy_keep_indices,
    save_policy,
    train_policy,
)
from slimkit.primitives.select.plan import SelectionRules, solve_fraction
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.context import Context
from slimkit.recipes.registry import register_stage
from slimkit.recipes.schema import Strict
from slimkit.recipes.stages.prune import TARGET_PART


class PruneNetArgs(Strict):
    selection: Literal["policy", "random", "deterministic"] = "policy"
    """``policy`` samples from the learned distribution; ``random`` / ``deterministic`` (top-k of
    W_imp) are the Tables 16-17 ablations."""
    source: Literal["up", "gate", "down"] = "up"
    """Which matrix the policy reads: FFN1 (``up``), the gate, or FFN2's columns (Table 19)."""
    episodes: int = Field(20, ge=0)
    learning_rate: float = Field(5e-4, gt=0)
    gamma: float = Field(0.99, ge=0.0, le=1.0)
    baseline: bool = False
    distance: Literal["ks", "ad"] = "ks"
    spectrum_dtype: Literal["float32", "float64"] = "float32"
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of each layer's MLP channels to remove; None follows the recipe target."""
    schedule: Literal["uniform", "linear"] = "uniform"
    policy: str | None = None
    """Folder of a saved policy to reuse without training."""
    save_policy: bool = True


def _channel_ratio(ctx: Context) -> float:
    target = ctx.recipe.target
    if target.of == "mlp":
        return target.ratio
    groups = build_groups(ctx.model, "mlp_channel")
    part = TARGET_PART[target.of]
    wanted = round(target.ratio * ctx.params_before[part])
    return solve_fraction(ctx.model, groups, [torch.zeros(g.size) for g in groups], SelectionRules(), part, wanted)


@register_stage("prunenet", args=PruneNetArgs, scope="model")
def prunenet(ctx: Context, args: PruneNetArgs) -> None:
    """Learn (or load) a PruneNet policy from the FFN weights and remove MLP channels with it."""
    ratio = args.ratio if args.ratio is not None else _channel_ratio(ctx)
    weights = ffn_weights(ctx.model, args.source)
    ratios = layer_ratios(ratio, len(weights), args.schedule)
    report: dict = {"channel_ratio": ratio, "layer_ratios": ratios, "selection": args.selection}
    if args.policy is not None:
        policy = load_policy(Path(args.policy))
        report["policy"] = {"loaded_from": args.policy}
    elif args.selection == "random":  # the Table 16 ablation needs no learner
        n, d = weights[0].shape
        policy = PruneNetPolicy(n, d, selection="random")
        report["policy"] = {"episodes": 0}
    else:
        dtype = torch.float64 if args.spectrum_dtype == "float64" else torch.float32
        with ctx.tracker.task("prunenet policy", None):
            policy, training = train_policy(
                weights,
                ratios,
                episodes=args.episodes,
                lr=args.learning_rate,
                gamma=args.gamma,
                baseline=args.baseline,
                seed=ctx.recipe.seed,
                spectrum_dtype=dtype,
                distance=args.distance,
            )
        report["policy"] = {
            "episodes": len(training.episode_penalty),
            "episode_penalty": training.episode_penalty,
            "seconds": training.seconds,
        }
        if args.save_policy:
            ctx.artifacts["policy"] = lambda folder, trained=policy: save_policy(trained, folder)
    groups = build_groups(ctx.model, "mlp_channel")
    keeps = [
        policy_keep_indices(policy, weight, layer_ratio, args.selection, ctx.generator)
        for weight, layer_ratio in zip(weights, ratios, strict=True)
    ]
    for group, keep in zip(groups, keeps, strict=True):
        remove_units(ctx.model, group, keep)
    ctx.stage_report["prunenet"] = report
