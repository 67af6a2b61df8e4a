"""What the pruning stages share: the ``scorer`` argument and the statistics a scorer spec reads.

Every pruning stage (``prune``, ``prune_layer``, ``cce``) takes the same ``scorer`` field: a registered
scorer name or a composition (``{platon: coupled}``, ``{blend: {activation: 1, taylor: 1}}``), see
:mod:`slimkit.primitives.importance.compose`. The statistics are computed here, from the calibration
batches, only for what the spec reads: per-Linear input norms (``input_norms``) and calibration-loss
gradients (``gradients``), once over all batches, or once per batch when the spec smooths (PLATON).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import field_validator, model_validator
from torch import nn

from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.calibration import input_norm_hooks
from slimkit.primitives.calibration.gradients import accumulate_gradients
from slimkit.primitives.device.memory_model import FLOAT32, ModelShape, StageMemory, backward_activation_bytes
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import Group
from slimkit.primitives.importance import (
    Aggregation,
    ScorerSpec,
    TaylorLevel,
    TaylorOrder,
    parse_scorer,
    spec_needs,
    spec_smooths,
)
from slimkit.primitives.importance.compose import describe, spec_gradients, spec_kinds
from slimkit.recipes.stage_args import ALL_ROLES, ReadsData, StageArgs

KIND_ROLES: dict[str, frozenset[LinearRole]] = {
    "attention_head": frozenset({"q", "k", "v", "o"}),
    "kv_group": frozenset({"q", "k", "v", "o"}),
    "mlp_channel": frozenset({"gate", "up", "down"}),
    "hidden_feature": ALL_ROLES,
    "q_latent": frozenset({"q"}),  # MLA: q_b's columns (and q_a's rows, not a role)
    "kv_latent": frozenset({"k"}),  # MLA: kv_b's columns (and kv_a's rows)
    "linear_head": frozenset(),  # a hybrid's mixer projections, which no role names
    "linear_kv_group": frozenset(),
    "mamba_head": frozenset(),
    "mamba_channel": frozenset(),
}


def roles_of(kinds: Sequence[str]) -> frozenset[LinearRole]:
    """Projection roles that removing units of these group kinds slices."""
    roles: frozenset[LinearRole] = frozenset()
    return roles.union(*(KIND_ROLES[k] for k in kinds))


def _non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """The dotted path and value of the first inf/NaN number inside a scorer spec, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        found = _non_finite(inner, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class ScoringArgs(StageArgs, ReadsData):
    scorer: str | dict[str, Any] = "activation"
    """Importance scorer: a registered name (activation, magnitude, taylor, random, coupled), or
    {platon: SPEC, x1, x2} (PLATON-smoothed over calibration batches), or {blend: {NAME: weight, ...}}."""
    aggregation: Aggregation = "l2"
    """How a unit's per-element scores are reduced (magnitude, activation, element-level taylor)."""
    order: TaylorOrder = "first"
    """Taylor term: first g*w, second 0.5*h*w^2 (h = squared gradients), or their difference (taylor only)."""
    level: TaylorLevel = "vector"
    """Taylor element-wise (aggregate |salience|) or vector-wise (|sum of salience|) importance (taylor only)."""
    stats_device: Literal["model", "cpu"] = "model"
    """Where the float32 gradient sums live (scorers that read gradients): model (each weight's device) or cpu
    (host memory, when the accelerator cannot hold them beside the weights)."""
    checkpoint_layers: bool = False
    """Recompute each decoder layer in the calibration backward instead of keeping its activations
    (scorers that read gradients): less memory at a large calibration batch, about a third more compute."""

    @model_validator(mode="after")
    def _gradient_options(self) -> ScoringArgs:
        for field, default in (("stats_device", "model"), ("checkpoint_layers", False)):
            if getattr(self, field) != default and "gradients" not in self.needs():
                raise ValueError(f"{field}: only for scorers that read gradients; {self.scorer_name()} reads none")
        return self

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        where = _non_finite(value)
        if where is not None:  # a blend weight or a PLATON x1/x2 of inf/NaN
            raise ValueError(f"{where[0]}: must be a finite number, got {where[1]!r}")
        parse_scorer(value)
        return value

    calibration_depends_on: ClassVar[tuple[str, ...]] = ("scorer",)

    def scorer_spec(self) -> ScorerSpec:
        return parse_scorer(self.scorer)

    def needs_gradients(self) -> bool:
        return "gradients" in self.needs()

    def add_backward_activations(self, memory: StageMemory, inputs: MemoryInputs) -> StageMemory:
        """``memory`` with the activations the calibration loss's backward keeps (per layer, or only each layer's
        input with ``checkpoint_layers``) at one calibration batch."""
        memory.parts["activations"] = backward_activation_bytes(
            inputs.shape, inputs.tokens, inputs.dtype_bytes, self.checkpoint_layers
        )
        return memory

    def scorer_args(self) -> dict[str, Any]:
        return {"aggregation": self.aggregation, "order": self.order, "level": self.level}

    def needs(self) -> set[str]:
        return spec_needs(self.scorer_spec())

    def scorer_name(self) -> str:
        return describe(self.scorer_spec())

    def check_kinds(self, kinds: Sequence[str]) -> None:
        """Raise ``ValueError`` (a validation message) when the scorer cannot score one of ``kinds``."""
        allowed = spec_kinds(self.scorer_spec())
        if allowed is not None:
            wrong = [k for k in kinds if k not in allowed]
            if wrong:
                kinds = ", ".join(sorted(allowed))
                raise ValueError(f"scorer: {self.scorer_name()} cannot score {wrong[0]} groups; it scores {kinds}")


def scored_params(shape: ModelShape, kinds: Sequence[str], layers: int) -> int:
    """Parameters whose gradients a scorer of these group kinds reads, over ``layers`` eligible layers."""
    if "hidden_feature" in kinds:
        return shape.total_params()
    per_layer = 0
    if {"attention_head", "kv_group", "q_latent", "kv_latent"} & set(kinds):
        per_layer += shape.attention_params()
    if "mlp_channel" in kinds:
        per_layer += shape.mlp_params()
    return per_layer * layers


def largest_scored(shape: ModelShape, kinds: Sequence[str]) -> int:
    """Parameters of the largest weight a scorer of these group kinds reads: the embedding for hidden features, else
    one MLP matrix."""
    return shape.embedding_params() if "hidden_feature" in kinds else shape.mlp_params() // 3


def scoring_bytes(shape: ModelShape, kinds: Sequence[str]) -> int:
    """What scoring the largest scored weight holds: the weight upcast to float32, its salience or magnitude and its
    units gathered (three float32 copies; the scorers see each weight in float32, ``member_sum``)."""
    return 3 * largest_scored(shape, kinds) * FLOAT32


def with_scoring(memory: StageMemory, scoring: int, before: Sequence[str], what: str = "scoring") -> StageMemory:
    """``memory`` with ``scoring`` bytes of scoring (``what``: its name), which runs after the parts named in
    ``before`` are freed (a backward's activations, its last gradient): counted instead of them where it is
    larger."""
    held = sum(memory.parts.get(name, 0) for name in before)
    if scoring > held:
        for name in before:
            memory.parts.pop(name, None)
        memory.parts[what if not held else f"{' and '.join(before)} or {what}"] = scoring
    return memory


def input_norms(model: nn.Module, batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` of every projection's input over the batches (one forward pass per batch)."""
    with input_norm_hooks(ModelView(model).linears()) as accumulators, torch.no_grad():
        for batch in batches:
            model(to_input_device(model, batch), use_cache=False)
    return {path: acc.norms() for path, acc in accumulators.items()}


def evaluations(
    model: nn.Module,
    spec: ScorerSpec,
    batches: Sequence[torch.Tensor],
    groups: list[Group] | None = None,
    args: ScoringArgs | None = None,
) -> Iterator[dict]:
    """Statistics dicts for the spec: one over all batches, or one per batch when the spec smooths.

    With ``groups`` (and the stage's ``args``), gradients are gathered only for the tensors and moments the
    spec's scorers read for those groups, where ``args.stats_device`` says; without, for every parameter."""
    needs = spec_needs(spec)
    if needs and not batches:
        raise SlimkitError(f"scorer {describe(spec)} needs calibration data, and the recipe has none")
    if "gradients" in needs and ModelView(model).head is None:
        raise SlimkitError(
            f"scorer {describe(spec)} needs a causal LM (the calibration loss); this model has no LM head"
        )
    chunks = [[b] for b in batches] if spec_smooths(spec) and batches else [list(batches)]
    request = spec_gradients(spec, model, groups, args.scorer_args() if args else {}) if groups is not None else None
    options = gradient_options(args) if args is not None else {}
    for chunk in chunks:
        stats: dict = {}
        if "input_norms" in needs:
            stats["input_norms"] = input_norms(model, chunk)
        if "gradients" in needs:
            if request is None:
                stats["gradients"] = accumulate_gradients(model, chunk, **options)
            else:
                tensors, squares = list(request.tensors), request.squares
                stats["gradients"] = accumulate_gradients(model, chunk, tensors=tensors, squares=squares, **options)
        yield stats


def gradient_options(args: ScoringArgs) -> dict:
    """``accumulate_gradients`` keywords from the stage's gradient settings."""
    return {
        "stats_device": "cpu" if args.stats_device == "cpu" else None,
        "checkpoint_layers": args.checkpoint_layers,
    }
