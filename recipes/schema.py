"""The recipe schema (pydantic). A bad recipe fails with the field path and the allowed values.

```yaml
name: wanda-channels
model: smollm2-135m            # a named source or a local folder
seed: 0
calibration: {dataset: c4, samples: 32, seq_len: 128, batch_size: 8}
target: {ratio: 0.2, of: mlp}  # what the ratio is of: model | layers | mlp | attention
stages:
  - stage: mlp_channels        # a registered stage and its arguments
    args: {scorer: activation, aggregation: l2}
  - sequential:                # children run layer by layer on captured layer inputs
      - stage: mlp_channels
eval:
  perplexity: {datasets: [wikitext2], seq_len: 512, max_tokens: 16384}
  zeroshot: {tasks: [piqa, arc_easy], limit: 100}
```
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from slimkit.primitives.textdata import CORPORA
from slimkit.recipes.registry import stage_def, stage_names

TargetOf = Literal["model", "layers", "mlp", "attention"]


class Strict(BaseModel):
    """Base of every recipe model: unknown fields fail with the list of allowed ones."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValueError(f"unknown field '{unknown[0]}'; allowed: {', '.join(cls.model_fields)}")
        return data


def check_corpus(name: str) -> str:
    if name not in CORPORA:
        raise ValueError(f"unknown dataset '{name}'; allowed: {', '.join(CORPORA)}")
    return name


class CalibrationConfig(Strict):
    dataset: str = "c4"
    samples: int = Field(32, ge=1)
    seq_len: int = Field(128, ge=2)
    batch_size: int = Field(8, ge=1)

    _dataset = field_validator("dataset")(check_corpus)


class Target(Strict):
    ratio: float = Field(ge=0.0, lt=1.0)
    of: TargetOf = "model"


class StageSpec(Strict):
    stage: str
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_stage_and_args(self) -> StageSpec:
        try:
            definition = stage_def(self.stage)
        except KeyError:
            raise ValueError(f"unknown stage '{self.stage}'; allowed: {', '.join(stage_names())}") from None
        try:
            self.args = definition.args.model_validate(self.args).model_dump()
        except ValidationError as error:
            raise ValueError(format_validation_error(error, prefix="args")) from None
        return self

    def parsed_args(self) -> BaseModel:
        return stage_def(self.stage).args.model_validate(self.args)


class SequentialSpec(Strict):
    sequential: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _layer_stages_only(self) -> SequentialSpec:
        for child in self.sequential:
            if stage_def(child.stage).scope != "layer":
                raise ValueError(f"stage '{child.stage}' works on the whole model and cannot run inside sequential")
        return self


def _stage_kind(value: Any) -> str:
    return "sequential" if isinstance(value, dict) and "sequential" in value else "stage"


StageItem = Annotated[
    Annotated[StageSpec, Tag("stage")] | Annotated[SequentialSpec, Tag("sequential")],
    Discriminator(_stage_kind),
]


class PerplexityEval(Strict):
    datasets: list[str] = Field(default_factory=lambda: ["wikitext2"])
    seq_len: int = Field(512, ge=2)
    max_tokens: int | None = Field(16384, ge=2)
    batch_size: int = Field(4, ge=1)

    @field_validator("datasets")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        return [check_corpus(n) for n in names]


class ZeroshotEval(Strict):
    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, ge=1)
    batch_size: int = Field(8, ge=1)

    @field_validator("tasks")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        from slimkit.primitives.evaluate.zeroshot import ZEROSHOT_TASKS

        for name in names:
            if name not in ZEROSHOT_TASKS:
                raise ValueError(f"unknown zero-shot task '{name}'; allowed: {', '.join(ZEROSHOT_TASKS)}")
        return names


class EvalConfig(Strict):
    perplexity: PerplexityEval | None = Field(default_factory=PerplexityEval)
    zeroshot: ZeroshotEval | None = None
    speed: bool = False


class Recipe(Strict):
    name: str
    description: str = ""
    paper: str | None = None
    model: str = "smollm2-135m"
    seed: int = 0
    calibration: CalibrationConfig | None = None
    target: Target
    stages: list[StageItem] = Field(min_length=1)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def flat_stages(self) -> list[StageSpec]:
        flat: list[StageSpec] = []
        for item in self.stages:
            flat.extend(item.sequential if isinstance(item, SequentialSpec) else [item])
        return flat

    def needs_calibration(self) -> bool:
        return any(stage_def(s.stage).needs_calibration(s.parsed_args()) for s in self.flat_stages())

    def calibration_config(self) -> CalibrationConfig | None:
        """Calibration settings when a stage needs them (the defaults if the recipe gives none)."""
        if not self.needs_calibration():
            return None
        return self.calibration or CalibrationConfig()


def _loc(parts: tuple[Any, ...]) -> str:
    # Drop pydantic's union tag ("stage"/"sequential" right after a list index) for readability.
    cleaned: list[str] = []
    for i, part in enumerate(parts):
        if i > 0 and isinstance(parts[i - 1], int) and part in ("stage", "sequential"):
            continue
        cleaned.append(str(part))
    return ".".join(cleaned)


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem, each ``field.path: message``; joined with '; '."""
    problems = []
    for item in error.errors():
        loc = _loc(tuple(item["loc"]))
        path = ".".join(p for p in (prefix, loc) if p)
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{path}: {message}" if path else message)
    return "; ".join(problems)
