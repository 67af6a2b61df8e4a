"""``prunenet`` (model scope): calibration-free MLP channel pruning with a learned policy.

PruneNet's policy learner scores the rows of every layer's FFN1 from the weights alone, trained with REINFORCE on the
spectral distance between the original and the compressed FFN1; the chosen channels are removed with the
MLP-channel group. No calibration data is read. The removal ratio follows the recipe target, or ``ratio``;
``policy: DIR`` loads a saved policy and skips training; the trained policy is saved as ``OUT/policy/`` unless
``save_policy: false``. The recipe ``seed`` seeds training and the final selection.

Method note: docs/methods/prunenet-policy.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import ArtifactWriter, StageResult
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import FLOAT32, FLOAT64, StageMemory
from slimkit.primitives.groups import build_groups
from slimkit.primitives.policy.prunenet import (
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
from slimkit.recipes.stage_args import BudgetMode, ChangesProjections, SharesTarget, StageArgs


class PruneNetArgs(StageArgs, SharesTarget, ChangesProjections, PlansMemory, ChecksModel):
    selection: Literal["policy", "random", "deterministic"] = "policy"
    """``policy`` samples from the learned distribution; ``random`` / ``deterministic`` (top-k of
    W_imp) are the Tables 16-17 ablations."""
    source: Literal["up", "gate", "down"] = "up"
    """Which matrix the policy reads: FFN1 (``up``), the gate, or FFN2's columns (Table 19)."""
    episodes: int = Field(20, ge=0)
    """REINFORCE episodes of policy training (the paper: 20; 0: the untrained initial policy, an ablation);
    ignored with ``policy`` or ``selection: random``."""
    learning_rate: float = Field(5e-4, gt=0, le=1.0)
    """AdamW learning rate of the policy (the paper: 5e-4)."""
    gamma: float = Field(0.99, ge=0.0, le=1.0)
    """Discount γ of the return (Eq. 7 / the released code's ``γ^l``), in [0, 1] (the paper: 0.99)."""
    returns: Literal["own", "future", "to_go"] = "own"
    """The return G_l each layer's action is scored with (``slimkit.primitives.policy.prunenet``'s docstring):
    ``own`` = γ^l · D_l, the layer's own KS penalty (Algorithm 1 lines 17-18 define D_l per layer; the
    authors' released code, ``_discount_rewards``, weights each layer by γ^i · reward_i); ``future`` =
    Σ_k γ^k D_{l+k+1}, Eq. 7 / Algorithm 1 line 19 as printed, which leaves the layer's own penalty out,
    so its expected update is zero; ``to_go`` = Σ_k γ^k D_{l+k} (own plus future penalties)."""
    update: Literal["layer", "episode"] = "layer"
    """``layer``: one AdamW step per layer after each episode's sampling, as the released code's
    ``_training`` does; ``episode``: one step per episode on the sum over layers (Algorithm 1 line 22)."""
    baseline: bool = False
    """Subtract the mean return of the previous episodes (per layer) to reduce the gradient's variance."""
    distance: Literal["ks", "ad"] = "ks"
    """Distance between singular-value spectra: ``ks`` (Kolmogorov-Smirnov, Eq. 6), ``ad`` (Anderson-Darling)."""
    spectrum_dtype: Literal["float32", "float64"] = "float32"
    """Precision of the singular-value computations (float64: slower, more exact)."""
    spectrum: Literal["gram", "svd"] = "gram"
    """How the singular values are computed: ``gram``, the square roots of the eigenvalues of the d x d Gram of the
    rows (one eigenvalue problem of the hidden size per spectrum: far cheaper on a GPU); ``svd``, ``svdvals`` of the
    rows (the former path). KS and Anderson-Darling read only the order of the values, which both give alike up to
    rounding (docs/methods/prunenet-policy.md)."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of each layer's MLP channels to remove; None follows the recipe target."""
    schedule: Literal["uniform", "linear"] = "uniform"
    """Per-layer ratios: ``uniform`` (all equal) or ``linear`` (a ramp, same mean, later layers lose less; Table 7)."""
    policy: str | None = None
    """Folder of a saved policy to reuse without training."""
    save_policy: bool = True
    """Save the trained policy with the run as OUT/policy/ (for reuse through ``policy``)."""

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """No pass through the model: the float32 policy (``W_inter`` n x d, ``W_proj``) with its gradients and AdamW's
        moments, one layer's FFN1 upcast for its logits, and one spectrum's work (the kept rows and their Gram, or
        the SVD's copy, in the spectrum's precision)."""
        n, d = inputs.shape.intermediate, inputs.shape.hidden
        precision = FLOAT64 if self.spectrum_dtype == "float64" else FLOAT32
        memory = StageMemory(stage, advice="set spectrum_dtype: float32")
        if self.policy is None and self.selection != "random":
            memory.parts["policy"] = 4 * (n * d + n) * FLOAT32
        memory.parts["spectrum"] = n * d * (FLOAT32 + precision) + d * d * precision
        return memory

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else "solve"

    def operations(self) -> frozenset[str]:
        return frozenset({"mlp_channel", "mlp_policy"})

    def touches(self) -> frozenset[LinearRole]:
        return frozenset({"gate", "up", "down"})


def _channel_ratio(ctx: Context) -> float:
    """The MLP-channel fraction that removes what is left of the recipe target: for ``of: mlp`` that share of
    the MLP (channels carry equal parameters), otherwise solved on exact counts, rounding included."""
    if ctx.recipe.target.of == "mlp":
        return ctx.params_to_remove() / ctx.block_params()["mlp"]
    groups = build_groups(ctx.model, "mlp_channel")
    scores = [torch.zeros(g.size) for g in groups]
    return solve_fraction(ctx.model, groups, scores, SelectionRules(), ctx.recipe.target.part, ctx.params_to_remove())


@register_stage(
    "prunenet",
    args=PruneNetArgs,
    paper="PruneNet Eqs. 3-7, Algorithm 1 (policy learning with a KS spectral reward)",
)
class PruneNet:
    """Learn (or load) a PruneNet policy from the FFN weights and remove MLP channels with it."""

    def run_model(self, ctx: Context, args: PruneNetArgs) -> StageResult:
        return prunenet(ctx, args)


def prunenet(ctx: Context, args: PruneNetArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    ratio = args.ratio if args.ratio is not None else _channel_ratio(ctx)
    weights = ffn_weights(ctx.model, args.source)
    ratios = layer_ratios(ratio, len(weights), args.schedule)
    report: dict = {"channel_ratio": ratio, "layer_ratios": ratios, "selection": args.selection}
    artifacts: dict[str, ArtifactWriter] = {}
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
                returns=args.returns,
                update=args.update,
                spectrum_method=args.spectrum,
            )
        report["policy"] = {
            "episodes": len(training.episode_penalty),
            "returns": args.returns,
            "update": args.update,
            "optimizer_steps": training.optimizer_steps,
            "spectrum": args.spectrum,
            "seed": ctx.recipe.seed,
            "episode_penalty": training.episode_penalty,
            "seconds": training.seconds,
        }
        if args.save_policy:
            trained = policy

            def write_policy(folder: Path) -> None:
                save_policy(trained, folder)

            artifacts["policy"] = write_policy
    policy.to(device=weights[0].device, dtype=torch.float32)  # float32 policy next to the weights it scores
    groups = build_groups(ctx.model, "mlp_channel")
    keeps = [
        policy_keep_indices(policy, weight, layer_ratio, args.selection, ctx.generator)
        for weight, layer_ratio in zip(weights, ratios, strict=True)
    ]
    for group, keep in zip(groups, keeps, strict=True):
        remove_units(ctx.model, group, keep)
    return StageResult(report, artifacts=artifacts)
