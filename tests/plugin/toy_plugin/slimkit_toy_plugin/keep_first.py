"""``keep_first_channels``: keep the first ``keep`` MLP channels of every layer (a model stage from a plugin)."""

from __future__ import annotations

from pydantic import Field

from slimkit.engine.capabilities import PlansRemoval
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.primitives.groups import build_groups
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.stage_args import BudgetMode, ChangesProjections, SharesTarget, StageArgs


class KeepFirstArgs(StageArgs, SharesTarget, PlansRemoval, ChangesProjections):
    keep: int = Field(48, ge=1)
    """MLP channels kept in every layer (the first ones)."""

    def budget(self) -> BudgetMode:
        return "explicit"

    def touches(self) -> frozenset:
        return frozenset({"gate", "up", "down"})


@register_stage("keep_first_channels", KeepFirstArgs, paper="none (a plugin test stage)")
class KeepFirstChannels:
    """Keep the first ``keep`` MLP channels of every layer."""

    def run_model(self, ctx: Context, args: KeepFirstArgs) -> StageResult:
        for group in build_groups(ctx.model, "mlp_channel"):
            remove_units(ctx.model, group, list(range(min(args.keep, group.size))))
        return StageResult({"kept": args.keep})
