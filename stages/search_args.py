"""The ``search`` stage's arguments: the candidates, the budgets beside the recipe's target, the store, a fixed choice.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from torch import nn

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.stage_memory import ACTIVATION_ADVICE, MemoryInputs
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import FLOAT64, StageMemory, forward_activation_bytes
from slimkit.primitives.device.placement import parse_size
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.candidates import PARTS, CandidateLadder, CandidateSpec, Part, refused_kinds
from slimkit.primitives.search.latency import PHASES, Phase, Runtime
from slimkit.primitives.settings import Strict
from slimkit.recipes.schema import Recipe, SizeText
from slimkit.recipes.stage_args import (
    ALL_ROLES,
    BudgetMode,
    ChangesProjections,
    ChecksRecipe,
    ReadsData,
    SharesTarget,
    StageArgs,
)


class MemoryBudget(Strict):
    """The model's memory at a context and batch: its weights plus its KV cache."""

    limit: SizeText
    """The most memory the searched model may take (e.g. 2GiB): weights at their dtype plus the KV cache."""
    context: int = Field(4096, ge=1)
    """Tokens per sequence the KV cache holds."""
    batch: int = Field(1, ge=1)
    """Sequences at once."""
    kv_bytes: int = Field(2, ge=1, le=8)
    """Bytes per cached key or value (2: float16 / bfloat16)."""

    def limit_bytes(self) -> int:
        return parse_size(self.limit, "memory_budget.limit")


class LatencyBudget(Strict):
    """A speed-up over the dense model in a runtime, against a table of measured per-candidate times."""

    speedup: float = Field(gt=1.0, le=100.0)
    """How many times faster than dense the searched model must be, in each phase of ``phases`` (estimated as the
    dense time plus every chosen candidate's measured per-layer time added)."""
    runtime: Runtime = "llama.cpp"
    """Where the model will be served: llama.cpp (GGUF, CPU, batch 1) or pytorch (the model's own device)."""
    phases: list[Phase] = Field(default_factory=lambda: list(PHASES), min_length=1)
    """Which times must meet the speed-up: prefill (the prompt), decode (each new token)."""
    context: int = Field(128, ge=2)
    """Prompt tokens of the timed prefill."""
    new_tokens: int = Field(32, ge=1)
    """Tokens of the timed decode."""
    repeats: int = Field(3, ge=1)
    """Timed runs per model (the median is kept)."""
    threads: int | None = Field(None, ge=1)
    """llama.cpp's threads (None: every core); PyTorch runs with the process's."""
    table: str | None = None
    """A latency table (JSON, as the search writes to its report folder) to use instead of measuring one."""

    @field_validator("phases")
    @classmethod
    def _once(cls, value: list[Phase]) -> list[Phase]:
        if len(set(value)) != len(value):
            raise ValueError("each phase once")
        return value


Choice = dict[int, dict[str, str]]
"""A fixed choice: per layer, per sub-block (attention, mlp), the candidate's name."""


class SearchArgs(StageArgs, SharesTarget, ChangesProjections, ReadsData, ChecksRecipe, PlansMemory, ChecksModel):
    candidates: CandidateLadder = Field(default_factory=CandidateLadder)
    """The levels tried in every layer (kept fractions; rounded to each layer's units)."""
    holdout: int = Field(1, ge=1)
    """Calibration batches (the last ones) the candidates are scored on (KL to the dense model); the rest build
    them."""
    damping: float = Field(0.1, ge=1e-12)
    """Ridge damping of the candidates' least-squares refits (a fraction of the mean diagonal of the kept inputs'
    Gram), as reconstruct's."""
    toward: Literal["zero", "kept"] = "kept"
    """What the refits' ridge pulls towards (reconstruct's toward)."""
    refit_chosen: Literal["sequential", "parent"] = "sequential"
    """How the chosen candidates are put in place: sequential: made again layer by layer on the inputs the layers
    before them (already replaced) give them, each refit against its parent's outputs there (as reconstruct refits
    inside sequential); parent: as they were scored, made on the dense model's inputs (read from the store)."""
    memory_budget: MemoryBudget | None = None
    """A memory budget beside the recipe's target (weights plus KV cache at a context and batch)."""
    latency_budget: LatencyBudget | None = None
    """A speed-up budget beside the recipe's target, against measured per-candidate times."""
    uniform: list[Part] = Field(default_factory=list)
    """Sub-blocks that take the same replacement in every layer of one shape (layers offering the same candidates):
    for runtimes that build every layer from one head count and MLP width (llama.cpp's Gemma, Granite and OLMo
    graphs among them: slimkit's GGUF pads per-layer widths for those, which keeps the parameters but not the
    speed). Empty: each layer chooses alone."""
    time_limit: float | None = Field(None, gt=0.0)
    """Seconds for the whole search: candidates not scored by then are left out (listed in the report), and the
    solver gets what is left (at least 10 s)."""
    store: bool = True
    """Keep built candidates and their scores on disk (SLIMKIT_CACHE_DIR/search), keyed by the model's weights, the
    calibration and these settings, so another search of the same model costs no new compression."""
    chosen: Choice | None = None
    """A fixed choice (what a search writes into its recipe): no scoring, no solver; each named candidate is built
    (or read from the store) and put in place. Layers or sub-blocks not named stay as they are."""

    @field_validator("chosen")
    @classmethod
    def _known_names(cls, value: Choice | None) -> Choice | None:
        for layer, parts in (value or {}).items():
            if layer < 0:
                raise ValueError(f"layer {layer}: layers count from 0")
            for part, name in parts.items():
                try:
                    CandidateSpec.parse(part, name)
                except SlimkitError as error:
                    raise ValueError(f"layer {layer}: {error}") from None
        return value

    @field_validator("uniform")
    @classmethod
    def _each_part_once(cls, value: list[Part]) -> list[Part]:
        if len(set(value)) != len(value):
            raise ValueError("each sub-block once")
        return value

    @model_validator(mode="after")
    def _something_to_choose(self) -> SearchArgs:
        if self.chosen is None and not self.candidates.kinds():
            raise ValueError("candidates: every level list is empty and no removal is allowed; nothing to choose")
        return self

    def budget(self) -> BudgetMode:
        return "solve"

    def needs_calibration(self) -> bool:
        return True

    def holdout_batches(self) -> int:
        return self.holdout

    def touches(self) -> frozenset[LinearRole]:
        return ALL_ROLES

    def makes_lowrank(self) -> frozenset[LinearRole]:
        ladder = self.candidates
        roles: set[LinearRole] = set()
        if ladder.attention_lowrank or self._chosen_kind("attention", "lowrank"):
            roles |= {"q", "k", "v", "o"}
        if ladder.mlp_lowrank or self._chosen_kind("mlp", "lowrank"):
            roles |= {"gate", "up", "down"}
        return frozenset(roles)

    def _chosen_kind(self, part: str, kind: str) -> bool:
        return any(
            name.partition(":")[0] == kind for p in (self.chosen or {}).values() for q, name in p.items() if q == part
        )

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        calibration = recipe.calibration
        if calibration is not None and calibration.samples <= self.holdout * calibration.batch_size:
            raise ValueError(
                f"{where}: holdout {self.holdout} leaves no calibration batch to build the candidates "
                f"on (calibration.samples {calibration.samples}, batch_size {calibration.batch_size})"
            )

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model the library has nothing for (every kind refused by its architecture) and a fixed choice
        naming a layer or sub-block it lacks. Kinds the architecture refuses are left out of the library (noted)."""
        refused = refused_kinds(model)
        wanted = self.candidates.kinds()
        if self.chosen is None and wanted and set(wanted) <= set(refused):
            raise SlimkitError(f"search: {refused[sorted(wanted)[0]]}; the library has nothing else to try")
        layers = ModelView(model).num_layers
        for layer, parts in (self.chosen or {}).items():
            if layer >= layers:
                raise SlimkitError(f"search: chosen names layer {layer}; the model has layers 0-{layers - 1}")
            for part in parts:
                if part not in PARTS:
                    raise SlimkitError(f"search: chosen layer {layer}: {part} is not attention or mlp")

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        """The dense log-probabilities and every layer's dense inputs on the held-out batches; one forward's
        activations; one layer's float64 Grams of the refit roles (the widest with its solve's temporaries, as
        reconstruct's plan counts them); a candidate and its parent's copy
        (two layers' weights at most); a latency probe's copy of the model (when measuring a latency table)."""
        shape = inputs.shape
        memory = StageMemory(stage, advice=f"{ACTIVATION_ADVICE}, or lower the search's holdout")
        memory.parts["dense log-probs"] = inputs.log_prob_bytes(self.holdout)
        held_tokens = self.holdout * inputs.tokens
        memory.parts["held-out layer inputs"] = shape.layers * held_tokens * shape.hidden * inputs.dtype_bytes
        memory.parts["activations"] = forward_activation_bytes(shape, inputs.tokens, inputs.dtype_bytes)
        width = {"q": shape.hidden, "k": shape.hidden, "v": shape.hidden, "gate": shape.hidden, "up": shape.hidden}
        width |= {"o": shape.q_width, "down": shape.intermediate}
        roles = self.refit_roles()
        widest = max((width[role] for role in roles), default=0)
        grams = sum(width[role] ** 2 for role in roles) - widest**2 + 5 * widest**2  # the widest one solved
        memory.parts["one layer's Grams and solves"] = grams * FLOAT64
        memory.parts["a candidate and its parent's copy"] = 2 * shape.layer_params() * inputs.dtype_bytes
        if self.latency_budget is not None and self.latency_budget.table is None and self.chosen is None:
            memory.parts["a latency probe (a copy of the model)"] = shape.total_params() * inputs.dtype_bytes
        return memory

    def refit_roles(self) -> list[LinearRole]:
        """The projections whose dense input Grams the candidates are refit against (their consumers, the low-rank
        roles)."""
        ladder = self.candidates
        roles: set[LinearRole] = set()
        if ladder.heads or ladder.kv_groups:
            roles.add("o")
        if ladder.channels:
            roles.add("down")
        if ladder.attention_lowrank:
            roles |= {"q", "k", "v", "o"}
        if ladder.mlp_lowrank:
            roles |= {"gate", "up", "down"}
        return sorted(roles)


def chosen_specs(chosen: Choice) -> dict[tuple[int, str], CandidateSpec]:
    """A fixed choice as specs by ``(layer, part)``."""
    return {
        (layer, part): CandidateSpec.parse(part, name)
        for layer, parts in chosen.items()
        for part, name in parts.items()
    }


def search_settings(args: SearchArgs) -> dict[str, Any]:
    """The arguments a written recipe keeps (all but the budgets and constraints, which a fixed choice no longer
    reads)."""
    return args.model_dump(mode="json", exclude={"memory_budget", "latency_budget", "uniform", "time_limit", "chosen"})


__all__ = ["Choice", "LatencyBudget", "MemoryBudget", "SearchArgs", "chosen_specs", "search_settings"]
