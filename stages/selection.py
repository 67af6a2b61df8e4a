"""The selection arguments every pruning stage shares (``prune``, ``prune_layer``, ``obs_prune_layer``): how much
each group loses (an explicit ``ratio`` or the recipe budget's ``ratio_rule``), how the budget is shared among layers
(``allocation``; layer-wise stages only), which layers are eligible, and the kept-count rules (``round_to``, with the
recipe's ``target.align``). ``K`` is the stage's unit kinds (the keys ``round_to`` accepts)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from slimkit.engine.capabilities import ChecksModel, ChecksReach, PlansRemoval
from slimkit.engine.context import Context
from slimkit.primitives.allocate.allocation_settings import Allocation, GlobalSettings, SearchSettings, parse_allocation
from slimkit.primitives.importance.obs_saliency import OBS_CONSUMERS
from slimkit.primitives.select.plan import SelectionRules, TargetOutOfReach
from slimkit.recipes.schema import Recipe, Target
from slimkit.recipes.stage_args import BudgetMode, ChecksRecipe, ReadsData, SharesTarget, StageArgs
from slimkit.stages.layer_rule import check_layer_rule

K = TypeVar("K", bound=str)


class SelectionArgs(
    StageArgs, SharesTarget, PlansRemoval, ReadsData, ChecksRecipe, ChecksModel, ChecksReach, Generic[K]
):
    groups: list[K] = Field(default_factory=lambda: default_groups(), min_length=1)
    """Unit kinds to prune, each once: mlp_channel (MLP channels, read by down_proj), attention_head (query heads,
    evenly per KV group; read by o_proj), kv_group (a KV head with its query heads; prune, prune_layer),
    hidden_feature (one residual-stream dimension everywhere; prune only), q_latent / kv_latent (a query or key-value
    latent channel of multi-head latent attention: choosing the rank of its low-rank pair; prune, prune_layer)."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    """Fraction of units removed from every group; None: set by ratio_rule from the recipe target."""
    ratio_rule: Literal["solve", "layer"] = "solve"
    """With ratio None: solve (remove what is left of the target) or layer (LoRAP's Ratio_l, Appendix C.1)."""
    skip_first: int = Field(0, ge=0)
    """Leave the first this many decoder layers dense."""
    skip_last: int = Field(0, ge=0)
    """Leave the last this many decoder layers dense."""
    round_to: dict[K, int] = Field(default_factory=dict)
    """Kept units of a kind rounded to a multiple (e.g. {mlp_channel: 8} for fast kernels)."""
    min_keep: int = Field(1, ge=1)
    """Fewest units any group keeps."""
    allocation: str | dict[str, Any] = "uniform"
    """How the target is shared among the eligible layers (layer-wise stages): uniform (every layer loses the same
    fraction), {global: {max_fraction, by}} (FLAP: every unit ranked on one scale after per-layer standardisation;
    by: refit_error, the counts with the least total relative refit error of the units' consumers) or
    {search: {budget_s, max_evals, seed, levels, holdout_batches, offspring}} (EvoPress: per-layer levels searched
    by KL divergence to the dense model on held-out calibration batches). Decided before the block runs."""

    allocates: ClassVar[bool] = False
    """Whether the stage takes an allocation other than uniform (a layer-wise stage that solves on the target)."""

    def operations(self) -> frozenset[str]:
        return frozenset(self.groups)

    @field_validator("allocation")
    @classmethod
    def _known_allocation(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        parse_allocation(value)
        return value

    @model_validator(mode="after")
    def _kinds_once_and_multiples(self) -> SelectionArgs:
        if len(set(self.groups)) != len(self.groups):
            raise ValueError(f"groups: each kind once (got {', '.join(self.groups)})")
        if any(v < 1 for v in self.round_to.values()):
            raise ValueError("round_to: multiples must be >= 1")
        return self

    @model_validator(mode="after")
    def _allocation_applies(self) -> SelectionArgs:
        chosen = self.allocation_settings()
        if chosen == "uniform":
            return self
        name = "search" if isinstance(chosen, SearchSettings) else "global"
        if not self.allocates:
            raise ValueError(
                f"allocation: {name} shares the target among layers before a layer-wise block runs; this stage "
                "scores the whole model at once (use selection: global here, or prune_layer / obs_prune_layer)"
            )
        if self.ratio is not None:
            raise ValueError(
                f"allocation: {name} decides each layer's share of the target, and ratio {self.ratio:g} fixes one "
                "share for every layer; drop ratio or use allocation: uniform"
            )
        if self.ratio_rule != "solve":
            raise ValueError(f"allocation: {name} needs ratio_rule: solve (the layer rule fixes one share per layer)")
        if isinstance(chosen, GlobalSettings) and chosen.by == "refit_error":
            other = [kind for kind in self.groups if kind not in OBS_CONSUMERS]
            if other:
                raise ValueError(
                    f"allocation: global by refit_error measures the refit of the units' consumer, which only "
                    f"{' and '.join(OBS_CONSUMERS)} units have (got {', '.join(other)}); use by: score"
                )
        return self

    def allocation_settings(self) -> Allocation:
        """The parsed ``allocation``: ``"uniform"`` or the settings of a global ranking or a search."""
        return parse_allocation(self.allocation)

    def holdout_batches(self) -> int:
        """Calibration batches a search holds out (0 without a search)."""
        chosen = self.allocation_settings()
        return chosen.holdout_batches if isinstance(chosen, SearchSettings) else 0

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """``round_to`` and ``target.align`` agree where both round a kind; a search's held-out batches leave
        calibration batches to score on; LoRAP's layer rule counts the whole model."""
        if self.ratio is None and self.ratio_rule == "layer":
            check_layer_rule(recipe, where)
        aligned = recipe.target.multiples(list(self.round_to))
        for kind, multiple in self.round_to.items():
            if kind in aligned and aligned[kind] != multiple:
                raise ValueError(
                    f"{where}: round_to.{kind} {multiple} conflicts with target.align.{kind} "
                    f"{recipe.target.align[kind]}; declare it once (target.align applies to every stage)"
                )
        holdout = self.holdout_batches()
        if holdout:
            config = recipe.calibration_config()
            batches = -(-config.samples // config.batch_size) if config is not None else 0
            if holdout >= batches:
                raise ValueError(
                    f"{where}: allocation.search.holdout_batches {holdout} leaves none of the {batches} "
                    "calibration batch(es) to score on; lower it or raise calibration.samples"
                )

    def reach_check(self, ctx: Context, stage: str) -> None:
        """A layer-wise stage solving on the target: a uniform share solved on the shapes, or an allocation refused
        when even every group at its fewest allowed units falls short."""
        if not (self.allocates and self.budget() == "solve"):
            return
        if self.allocation_settings() == "uniform":
            from slimkit.stages.prune import layer_fraction

            layer_fraction(ctx, self, stage)
            return
        from slimkit.stages.selection_prepass import check_reachable

        check_reachable(ctx, stage, self)

    def rules(self) -> SelectionRules:
        """How scores become kept counts (each stage's own rules)."""
        raise NotImplementedError

    def allocation_scorer(self) -> tuple[Any, dict]:
        """The scorer spec (and its keyword arguments) the allocation pre-pass ranks units by (layer-wise stages)."""
        raise NotImplementedError

    def rules_for(self, target: Target) -> SelectionRules:
        """The stage's rules with the target's alignment of its kinds (the recipe checks that both agree)."""
        rules = self.rules()
        aligned = target.multiples(list(self.groups))
        if not aligned:
            return rules
        return dataclasses.replace(rules, round_to={**rules.round_to, **aligned})

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else self.ratio_rule


def default_groups() -> list[Any]:
    """The unit kinds a selection stage prunes when none are given: MLP channels."""
    return ["mlp_channel"]


def nearest_ratios(target: Target, dense: int, wanted: int, miss: TargetOutOfReach) -> str:
    """The ratios of the target the nearest plans on either side of ``wanted`` reach, as ``a% or b%``."""
    reached = (miss.below, miss.above)
    ratios = (max(0.0, target.ratio + (removed - wanted) / dense) for removed in reached if removed is not None)
    return " or ".join(f"{ratio:.2%}" for ratio in ratios)


def out_of_reach(name: str, args: SelectionArgs, target: Target, nearest: str) -> str:
    """The one line refusing a target no plan of the stage's units lands on (with the alignment, if any)."""
    aligned = target.multiples(list(args.groups))
    alignment = f", aligned as target.align {', '.join(f'{k}: {target.align[k]}' for k in aligned)}," if aligned else ""
    return (
        f"{name}: groups {', '.join(args.groups)} (skip_first {args.skip_first}, skip_last {args.skip_last})"
        f"{alignment} cannot remove {target.ratio:.1%} of {target.of} within target.tolerance {target.tolerance:.1%}: "
        f"the nearest plans remove {nearest}; widen target.tolerance, "
        + ("use a smaller target.align multiple, " if aligned else "")
        + ("" if "mlp_channel" in args.groups else "add a finer group kind (e.g. mlp_channel), ")
        + "or change skip_first/skip_last"
    )


__all__ = ["SelectionArgs", "nearest_ratios", "out_of_reach"]
