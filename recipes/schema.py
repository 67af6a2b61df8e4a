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

GLUE (BERT encoders): ``task: sst2`` (or mrpc, rte, stsb) makes the loaded encoder a sequence
classifier for that task (:func:`slimkit.primitives.finetune.glue.task_model`), lets stages that need
a task model run (``glue_finetune``), lets ``calibration.dataset: glue`` mean that task's train split,
and changes the evaluation defaults: ``eval.glue`` on the task's dev split instead of perplexity
(a classifier has no language-model head, so ``eval.perplexity`` and ``eval.zeroshot`` are refused).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from slimkit.primitives.textdata import CORPORA
from slimkit.recipes.registry import stage_def, stage_names

T = TypeVar("T")

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

    def shared_with(self, config_class: type[T], **extra: Any) -> T:
        """``config_class`` (a dataclass) built from the fields it shares with these args, plus ``extra``."""
        names = {f.name for f in dataclasses.fields(config_class)} & set(type(self).model_fields)  # type: ignore[arg-type]
        return config_class(**{name: getattr(self, name) for name in names}, **extra)


def check_corpus(name: str) -> str:
    if name not in CORPORA:
        raise ValueError(f"unknown dataset '{name}'; allowed: {', '.join(CORPORA)}")
    return name


def check_zeroshot_task(name: str) -> str:
    from slimkit.primitives.evaluate.zeroshot import ZEROSHOT_TASKS

    if name not in ZEROSHOT_TASKS:
        raise ValueError(f"unknown zero-shot task '{name}'; allowed: {', '.join(ZEROSHOT_TASKS)}")
    return name


def check_glue_task(name: str) -> str:
    from slimkit.primitives.gluedata import GLUE_TASKS

    if name not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task '{name}'; allowed: {', '.join(GLUE_TASKS)}")
    return name


def is_glue_dataset(name: str) -> bool:
    return name == "glue" or name.startswith("glue-")


def check_calibration_dataset(name: str) -> str:
    """A text corpus, ``glue`` (the recipe's task's train split) or ``glue-<task>``."""
    from slimkit.primitives.gluedata import GLUE_TASKS

    tasks = [f"glue-{t}" for t in GLUE_TASKS]
    if name in CORPORA or name == "glue" or name in tasks:
        return name
    raise ValueError(
        f"unknown dataset '{name}'; allowed: {', '.join(CORPORA)}, glue (the recipe's task), {', '.join(tasks)}"
    )


class CalibrationConfig(Strict):
    dataset: str = "c4"
    samples: int = Field(32, ge=1)
    seq_len: int = Field(128, ge=2)
    batch_size: int = Field(8, ge=1)
    examples: int = Field(512, ge=1)
    """GLUE datasets only: training examples drawn and packed before the windows are cut (SP3: 512)."""

    _dataset = field_validator("dataset")(check_calibration_dataset)

    @model_validator(mode="after")
    def _examples_for_glue_only(self) -> CalibrationConfig:
        if "examples" in self.model_fields_set and not is_glue_dataset(self.dataset):
            raise ValueError("examples: applies to GLUE calibration datasets only (glue, glue-<task>)")
        return self


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
        return [check_zeroshot_task(n) for n in names]


class GlueEval(Strict):
    task: str | None = None
    """A GLUE task; None: the recipe's ``task`` (else the task the model records, ``finetuning_task``)."""
    limit: int | None = Field(None, ge=1)
    """The first ``limit`` dev examples in file order (None: the whole dev split)."""
    batch_size: int = Field(32, ge=1)
    max_length: int = Field(128, ge=8)

    @field_validator("task")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return name if name is None else check_glue_task(name)


class EvalConfig(Strict):
    perplexity: PerplexityEval | None = Field(default_factory=PerplexityEval)
    zeroshot: ZeroshotEval | None = None
    speed: bool = False
    glue: GlueEval | None = None


class Recipe(Strict):
    name: str
    description: str = ""
    paper: str | None = None
    model: str = "smollm2-135m"
    task: str | None = None
    """A GLUE task (sst2, mrpc, rte, stsb): the model becomes a sequence classifier for it (see above)."""
    seed: int = 0
    calibration: CalibrationConfig | None = None
    target: Target
    stages: list[StageItem] = Field(min_length=1)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str | None) -> str | None:
        return name if name is None else check_glue_task(name)

    @model_validator(mode="after")
    def _task_rules(self) -> Recipe:
        for index, spec in enumerate(self.flat_stages()):
            if self.task is None and stage_def(spec.stage).needs_task:
                raise ValueError(f"stages.{index}: stage '{spec.stage}' needs the recipe's task (a GLUE task)")
        if self.task is None:
            if self.calibration is not None and self.calibration.dataset == "glue":
                raise ValueError("calibration.dataset: glue means the recipe's task, but task is not set")
            return self
        evaluation = self.eval
        if "perplexity" not in evaluation.model_fields_set:
            evaluation.perplexity = None
        if "glue" not in evaluation.model_fields_set:
            evaluation.glue = GlueEval()
        if evaluation.perplexity is not None:
            raise ValueError("eval.perplexity: a GLUE task model has no language-model head; set it to null")
        if evaluation.zeroshot is not None and evaluation.zeroshot.tasks:
            raise ValueError("eval.zeroshot: a GLUE task model has no language-model head; set it to null")
        if evaluation.glue is not None:
            if evaluation.glue.task not in (None, self.task):
                raise ValueError(
                    f"eval.glue.task: the recipe's task is {self.task}; its model cannot be evaluated on "
                    f"{evaluation.glue.task}"
                )
            evaluation.glue.task = self.task
        return self

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
        config = self.calibration or CalibrationConfig()
        if config.dataset == "glue":
            return config.model_copy(update={"dataset": f"glue-{self.task}"})
        return config


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
