"""The selection arguments every pruning stage shares (``prune``, ``prune_layer``, ``obs_prune_layer``): how much
each group loses (an explicit ``ratio`` or the recipe budget's ``ratio_rule``), which layers are eligible, and the
kept-count rules. ``K`` is the stage's unit kinds (the keys ``round_to`` accepts)."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import Field, model_validator

from slimkit.recipes.stage_args import BudgetMode, StageArgs

K = TypeVar("K", bound=str)


class SelectionArgs(StageArgs, Generic[K]):
    groups: list[K] = Field(default_factory=lambda: ["mlp_channel"], min_length=1)
    """Unit kinds to prune, each once: mlp_channel (MLP channels, read by down_proj), attention_head (query heads,
    evenly per KV group; read by o_proj), kv_group (a KV head with its query heads; prune, prune_layer),
    hidden_feature (one residual-stream dimension everywhere; prune only)."""
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

    @model_validator(mode="after")
    def _kinds_once_and_multiples(self) -> SelectionArgs:
        if len(set(self.groups)) != len(self.groups):
            raise ValueError(f"groups: each kind once (got {', '.join(self.groups)})")
        if any(v < 1 for v in self.round_to.values()):
            raise ValueError("round_to: multiples must be >= 1")
        return self

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else self.ratio_rule


__all__ = ["SelectionArgs"]
