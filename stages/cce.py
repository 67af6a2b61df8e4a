"""``cce`` (model scope): coupled-components elimination, iterative evaluate-and-prune (Algorithm 1).

Each iteration draws calibration samples, scores attention heads, MLP channels (per layer) and hidden features
(model-wide) with ``scorer`` (``coupled`` by default, from LoRA-proxy or full gradients, smoothed with PLATON), and
removes the lowest-scoring units in every layer. ``step`` (default 1/heads) is the fraction removed per iteration;
the final fraction is solved so what is left of the recipe target is removed, or given as ``ratio``; ``iterations``
splits it into equal steps. Under grouped-query attention query heads go evenly from every KV group and KV heads
are kept. A target beyond these floors fails before anything is pruned. The report gives, per iteration, the
fraction, seed, loss, widths, parameters, seconds and the gradient state's memory.

Method note: docs/methods/cce-coupled-scores.md.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import Field, model_validator

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, GRADIENT_ADVICE, MemoryInputs, forward_memory
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.device.memory_model import FLOAT32, StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.counting import params_by_part
from slimkit.primitives.evaluate.memory import MB, PeakRSS
from slimkit.primitives.groups import Group
from slimkit.primitives.importance.compose import ScoreAccumulator, Smoothed, score_groups, spec_gradients, spec_names
from slimkit.primitives.importance.lora_proxy import BatchGradients, LoraProxyConfig, full_gradients, lora_gradients
from slimkit.primitives.select.iterative import plan_schedule, run_schedule
from slimkit.recipes.stage_args import BudgetMode, ChangesProjections, SharesTarget
from slimkit.stages.scoring import (
    ScoringArgs,
    gradient_options,
    input_norms,
    roles_of,
    scored_params,
    scoring_bytes,
    with_scoring,
)

Kind = Literal["attention_head", "mlp_channel", "hidden_feature"]
KINDS: tuple[Kind, ...] = ("attention_head", "mlp_channel", "hidden_feature")
"""The kinds CCE eliminates, in the schedule's order (:data:`~slimkit.primitives.select.iterative.SCHEDULE_KINDS`)."""


class CceArgs(ScoringArgs, SharesTarget, ChangesProjections, PlansMemory, ChecksModel):
    scorer: str | dict = "coupled"
    """Importance scorer: coupled (CCE Eqs. 2-6, 8), magnitude (with aggregation l2: the paper's L2
    baseline), random, taylor, activation, or a composition ({blend: ...}; smoothing is ``platon``)."""
    kinds: list[Kind] = Field(default_factory=lambda: list(KINDS), min_length=1)
    """Which components are eliminated: attention_head, mlp_channel, hidden_feature."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    """Final fraction of every dense width removed; None: solved from what is left of the recipe target."""
    step: float | None = Field(None, gt=0.0, le=1.0)
    """Fraction of every dense width removed per iteration; None: 1/heads (the paper's one head per iteration)."""
    iterations: int | None = Field(None, ge=1)
    """Split the target into this many equal steps instead of ``step``."""
    feature_scope: Literal["query_head", "kv_group", "layer"] = "kv_group"
    """Where Eq. 8 takes |.| for hidden-feature scores (scorer coupled): per query head's product (the paper's
    per-head reading applied to GQA query heads, whose k/v gradient share is a minimum-norm guess),
    per KV group (the smallest product whose gradient the factors determine; equals query_head without
    GQA), or per layer. Recorded in the report; other scorers ignore it."""
    gradients: Literal["lora", "full"] = "lora"
    """Gradients the scorer reads: lora (LoRAPrune's Eq. 9 proxy, the paper's choice) or full (the true
    gradient of each calibration batch's loss w.r.t. the scored weights, back-propagated per batch and
    smoothed/averaged as scores). Memory of full: one gradient per scored weight in the weights' dtype,
    i.e. about the projection weights once more (135M float32: ~0.4 GB; a 7B model: ~13 GB in bfloat16,
    ~26 GB in float32) plus the backward pass's activations; lora holds only adapters and their factors."""
    lora_rank: int = Field(8, ge=1)
    """Rank of the proxy's LoRA adapters (gradients: lora)."""
    lora_alpha: float = Field(16.0, gt=0)
    """Scaling alpha of the proxy's adapters (gradients: lora)."""
    lora_steps: int = Field(5, ge=0)
    """AdamW steps on the iteration's samples before the proxy gradients are read (the paper: 5)."""
    lora_learning_rate: float = Field(1e-4, gt=0, le=1.0, allow_inf_nan=False)
    """Learning rate of those steps (gradients: lora)."""
    platon: bool = True
    """Smooth per-batch scores with PLATON (Eq. 7); false averages them."""
    x1: float = Field(0.5, ge=0.0, lt=1.0)
    """PLATON's importance smoothing factor (Eq. 7; the paper: 0.5)."""
    x2: float = Field(0.5, ge=0.0, lt=1.0)
    """PLATON's uncertainty smoothing factor (Eq. 7; the paper: 0.5)."""
    fresh_samples: bool = True
    """Draw new calibration samples for every iteration after the first (false: reuse the run's set)."""

    @model_validator(mode="after")
    def _compatible(self) -> CceArgs:
        self.check_kinds(self.kinds)
        if self.platon and isinstance(self.scorer_spec(), Smoothed):
            raise ValueError("scorer: platon is set twice (the stage's platon: true and the scorer's); give one")
        if self.step is not None and self.iterations is not None:
            raise ValueError("step and iterations: give one of them (or neither for 1/heads per iteration)")
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds: each kind once (got {', '.join(self.kinds)})")
        if self.gradients == "lora" and (self.stats_device != "model" or self.checkpoint_layers):
            raise ValueError(
                "stats_device / checkpoint_layers: apply to gradients: full (lora holds only adapter factors)"
            )
        if self.gradients == "lora" and "taylor" in spec_names(self.scorer_spec()):
            raise ValueError(
                "gradients: lora estimates Linear weights only, and taylor also scores embeddings and norms; "
                "use gradients: full with scorer: taylor"
            )
        return self

    def scorer_args(self) -> dict:
        return {**super().scorer_args(), "feature_scope": self.feature_scope}

    def scores_features_coupled(self) -> bool:
        """Whether ``feature_scope`` is read: the coupled scorer scores hidden features."""
        return "hidden_feature" in self.kinds and "coupled" in spec_names(self.scorer_spec())

    def needs_data(self) -> bool:
        return bool(self.needs())

    def needs_calibration(self) -> bool:
        return self.needs_data()

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else "solve"

    def operations(self) -> frozenset[str]:
        return frozenset(self.kinds)

    def touches(self) -> frozenset[LinearRole]:
        return roles_of(self.kinds)

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """A gradient scorer: the proxy's adapters with their gradients and AdamW state (``gradients: lora``) or one
        batch's gradient of every scored weight (``full``), and the backward's activations; else one forward's."""
        if not self.needs_gradients():  # one forward's activations (a data scorer's), freed before the scoring
            scoring = scoring_bytes(inputs.shape, self.kinds)
            return with_scoring(forward_memory(stage, inputs), scoring, ["activations"])
        shape = inputs.shape
        memory = StageMemory(stage, advice=GRADIENT_ADVICE)
        if self.gradients == "lora":
            linears = 4 * (shape.hidden + shape.q_width) + 3 * (shape.hidden + shape.intermediate)
            memory.parts["adapters"] = shape.layers * self.lora_rank * linears * FLOAT32 * 4  # weights, grads, AdamW
            memory.advice = ACTIVATION_ADVICE
        else:
            memory.parts["gradients"] = scored_params(shape, self.kinds, shape.layers) * inputs.dtype_bytes
        memory = self.add_backward_activations(memory, inputs)
        if "coupled" in spec_names(self.scorer_spec()) and {"attention_head", "hidden_feature"} & set(self.kinds):
            # after the backward: one KV group's float32 head products and their gradients, about five tensors of
            # (query heads per group) x d x d
            per_group = shape.heads // max(shape.kv_heads, 1)
            scoring = 5 * per_group * shape.hidden * shape.hidden * FLOAT32
            memory = with_scoring(memory, scoring, ["activations"], what="head scoring")
        return memory


def _batches(ctx: Context, args: CceArgs, iteration: int) -> tuple[list[torch.Tensor], int | None]:
    """The iteration's calibration batches and the seed they were drawn with."""
    if iteration == 0 or not args.fresh_samples:
        return ctx.calibration_batches(), ctx.recipe.seed
    config = ctx.recipe.calibration_config()
    if config is None:  # needs_calibration: the run has calibration settings
        raise SlimkitError("cce: fresh_samples needs the recipe's calibration settings")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator))
    ids = calibration_batches(ctx.tokenizer, CalibrationSpec(config.dataset, config.samples, config.seq_len, seed))
    return list(ids.split(config.batch_size)), seed


def _gradient_weights(ctx: Context, args: CceArgs, groups: list[Group]) -> list[torch.Tensor]:
    """Only the weights the scorers read for these groups (groups the stage does not prune need none)."""
    return list(spec_gradients(args.scorer_spec(), ctx.model, groups, args.scorer_args()).tensors)


def _evaluate(ctx: Context, args: CceArgs, groups: list[Group], batches, seed: int) -> tuple[list[torch.Tensor], dict]:
    """Scores of every group for one iteration, and what the evaluation cost."""
    scorer_args = args.scorer_args()
    spec = args.scorer_spec()
    if not args.needs_gradients():
        stats: dict = {"input_norms": input_norms(ctx.model, batches)} if "input_norms" in args.needs() else {}
        return score_groups(spec, groups, ctx.model, [stats], generator=ctx.generator, **scorer_args), {}
    weights = _gradient_weights(ctx, args, groups)
    accumulator = ScoreAccumulator(Smoothed(spec, args.x1, args.x2) if args.platon else spec)
    losses: list[float] = []
    report: dict = {}
    with PeakRSS() as memory:
        source: Iterable[BatchGradients]
        if args.gradients == "lora":
            config = LoraProxyConfig(args.lora_rank, args.lora_alpha, args.lora_steps, args.lora_learning_rate, seed)
            source = lora_gradients(ctx.model, batches, weights, config)
        else:
            source = full_gradients(ctx.model, batches, weights, **gradient_options(args))
        for batch, gradients in zip(batches, source, strict=True):
            stats = {"gradients": gradients}
            if "input_norms" in args.needs():
                stats["input_norms"] = input_norms(ctx.model, [batch])
            accumulator.update(groups, ctx.model, stats, generator=ctx.generator, **scorer_args)
            losses.append(gradients.loss)
            report = gradients.report
    scores = accumulator.scores(groups)
    cost = {
        "gradients": args.gradients,
        "batches": len(losses),
        "loss": sum(losses) / len(losses),
        "gradient_peak_mb": memory.delta_mb,
        "gradient_state_mb": report.get("state_bytes", 0) / MB,
    }
    return scores, cost


def _widths(ctx: Context) -> dict:
    view = ctx.view
    return {
        "heads": [layer.num_heads for layer in view.layers],
        "mlp": [layer.mlp_width for layer in view.layers],
        "hidden": view.hidden_size,
    }


@register_stage(
    "cce",
    args=CceArgs,
    paper="CCE Algorithm 1, Eqs. 2-8 (coupled components, PLATON smoothing Eq. 7)",
)
class Cce:
    """Iteratively score coupled components (heads, MLP kernels, features) and remove the lowest until the target."""

    def run_model(self, ctx: Context, args: CceArgs) -> StageResult:
        return cce(ctx, args)


def cce(ctx: Context, args: CceArgs) -> StageResult:
    """CCE's iterations on ``ctx.model``; the report entry and the manifest's record of the iterations' seeds."""
    if args.needs_gradients() and ModelView(ctx.model).head is None:
        raise SlimkitError(
            f"cce: scorer {args.scorer} needs a causal LM (the calibration loss); this model has no LM head"
        )
    schedule = plan_schedule(  # raises before any change when the floors forbid the target
        ctx.model,
        args.kinds,
        final=args.ratio,
        step=args.step,
        iterations=args.iterations,
        part=ctx.recipe.target.part,
        wanted=ctx.params_to_remove(),
    )
    history: list[dict] = []
    report = {
        "scorer": args.scorer_name(),
        "gradients": args.gradients if args.needs_gradients() else None,
        "feature_scope": args.feature_scope if args.scores_features_coupled() else None,
        "platon": args.platon,
        "kinds": list(args.kinds),
        "step": schedule.step,
        "final_fraction": schedule.final,
        "iterations": history,
    }
    state: dict = {}

    def score(iteration: int, groups: list[Group]) -> list[torch.Tensor]:
        state["started"] = time.perf_counter()
        batches, seed = _batches(ctx, args, iteration) if args.needs_data() else ([], None)
        scores, state["cost"] = _evaluate(ctx, args, groups, batches, seed if seed is not None else ctx.recipe.seed)
        state["seed"] = seed
        return scores

    with ctx.tracker.task("cce iterations", len(schedule.fractions)) as advance:

        def record(iteration: int, fraction: float) -> None:
            entry = {"iteration": iteration + 1, "fraction": fraction, "seed": state["seed"], **state["cost"]}
            entry.update(_widths(ctx))
            entry["params"] = params_by_part(ctx.model)["total"]
            entry["seconds"] = time.perf_counter() - state["started"]
            entry["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
            history.append(entry)
            advance(1)

        run_schedule(ctx.model, schedule, score, record)
    peaks = [h["gradient_peak_mb"] for h in history if "gradient_peak_mb" in h]
    if peaks:
        report["gradient_peak_mb"] = max(peaks)
        report["gradient_state_mb"] = max(h["gradient_state_mb"] for h in history if "gradient_state_mb" in h)
    manifest = {"iteration_seeds": [h["seed"] for h in history], "fractions": list(schedule.fractions)}
    return StageResult(report, manifest={"cce": manifest})
