"""The recipe schema (pydantic). A bad recipe fails with the field path and the allowed values.

```yaml
name: my-hybrid
model: smollm2-135m            # a named source or a local folder
seed: 0
calibration: {dataset: c4, samples: 32, seq_len: 128, batch_size: 8}
target: {ratio: 0.2, of: model} # the one budget: of model | layers | mlp | attention; tolerance, strict
stages:
  - sequential:                # children run layer by layer on captured layer inputs
      - stage: lowrank         # a registered stage (`slimkit stage list`) and its arguments
        args: {roles: [q, k, v, o], ratio: 0.3}    # an explicit share, checked against the target
  - stage: prune               # no ratio: removes what is left of the target
    args: {groups: [mlp_channel], scorer: {blend: {activation: 1, taylor: 1}}}
eval:
  perplexity: {datasets: [wikitext2], seq_len: 512, max_tokens: 16384}
  zeroshot: {tasks: [piqa, arc_easy], limit: 100}
```

Method note: docs/methods/recipes.md.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from slimkit.primitives.calibration.batches import CalibrationSpec
from slimkit.primitives.datasets.textdata import CORPORA
from slimkit.primitives.device.placement import check_device_name, check_dtype_name, parse_size
from slimkit.primitives.errors import SlimkitError, format_validation_error, unknown
from slimkit.primitives.evaluate.eval_settings import EvalConfig, GlueEval, check_glue_task
from slimkit.primitives.settings import Strict
from slimkit.recipes.catalogue import stage_def, stage_names
from slimkit.recipes.stage_args import ChangesProjections, ChecksRecipe, ReadsData, SharesTarget, StageArgs, offered

TargetOf = Literal["model", "layers", "mlp", "attention"]


def is_glue_dataset(name: str) -> bool:
    return name == "glue" or name.startswith("glue-")


def check_calibration_dataset(name: str) -> str:
    """A text corpus, ``glue`` (the recipe's task's train split) or ``glue-<task>``."""
    from slimkit.primitives.datasets.gluedata import GLUE_TASKS

    tasks = [f"glue-{t}" for t in GLUE_TASKS]
    if name in CORPORA or name == "glue" or name in tasks:
        return name
    # A misspelt ``glue-<task>`` is suggested a task, never the bare ``glue`` (which means another thing).
    suggest = tasks if name.startswith("glue-") else None
    allowed = [*CORPORA, "glue", *tasks]
    raise ValueError(unknown("dataset", name, allowed, tail=" (glue: the recipe's task)", suggest=suggest))


MAX_COUNT = 65_536
"""The most calibration samples, tokens per sample or samples per batch a recipe may ask for."""
MAX_EXAMPLES = 1_000_000
"""The most GLUE training examples a recipe may draw for calibration."""


CALIBRATION_BATCH_SIZE = 8
"""Calibration samples per forward pass, unless the recipe's ``calibration.batch_size`` says otherwise."""


class CalibrationConfig(Strict):
    dataset: str = "c4"
    samples: int = Field(32, ge=1, le=MAX_COUNT)
    seq_len: int = Field(128, ge=2, le=MAX_COUNT)
    batch_size: int = Field(CALIBRATION_BATCH_SIZE, ge=1, le=MAX_COUNT)
    examples: int = Field(512, ge=1, le=MAX_EXAMPLES)
    """GLUE datasets only: training examples drawn and packed before the windows are cut (SP3: 512)."""

    _dataset = field_validator("dataset")(check_calibration_dataset)

    @model_validator(mode="after")
    def _examples_for_glue_only(self) -> CalibrationConfig:
        if "examples" in self.model_fields_set and not is_glue_dataset(self.dataset):
            raise ValueError("examples: applies to GLUE calibration datasets only (glue, glue-<task>)")
        return self

    def spec(self, seed: int) -> CalibrationSpec:
        """The calibration set these settings draw with ``seed`` (``examples`` only for a GLUE dataset)."""
        examples = self.examples if is_glue_dataset(self.dataset) else None
        return CalibrationSpec(self.dataset, self.samples, self.seq_len, seed, examples=examples)


ALIGN_KINDS: tuple[str, ...] = ("mlp_channel", "attention_head", "kv_group")
"""The unit kinds ``target.align`` may round."""
# Which entry of ``params_by_part`` a target is a ratio of.
TARGET_PART: dict[str, str] = {"model": "total", "layers": "layers", "mlp": "mlp", "attention": "attention"}


class Target(Strict):
    """The recipe's one budget: remove ``ratio`` of the dense model's ``of`` parameters.

    Every stage that removes parameters either derives its share from what is left of this budget
    (parameters added or removed by earlier stages counted) or states its own ``ratio``; after the
    run the achieved ratio is checked against ``ratio`` within ``tolerance``.
    """

    ratio: float = Field(ge=0.0, lt=1.0, allow_inf_nan=False)
    """Fraction of the dense model's ``of`` parameters to remove."""
    of: TargetOf = "model"
    """What the ratio is of: the whole model, the decoder layers, the MLPs or the attention blocks."""
    tolerance: float = Field(0.005, ge=0.0, le=1.0, allow_inf_nan=False)
    """Largest accepted |achieved - ratio| (0.005 = half a percentage point)."""
    strict: bool = True
    """A run whose achieved ratio is outside the tolerance fails (nothing is written); false: it is
    kept and flagged (report ``target.met: false``)."""
    align: dict[str, int | Literal["kv_group"]] = Field(default_factory=dict)
    """Kept widths every pruning stage rounds to, by unit kind (e.g. {mlp_channel: 64, attention_head: kv_group}):
    mlp_channel or kv_group an integer multiple; attention_head an integer multiple of kept query heads, or kv_group
    (every KV group keeps the same number of query heads, the GQA layout llama.cpp needs; the selection already keeps
    it). A stage's own round_to for the same kind must agree; the solver lands on the ratio with these widths."""

    @field_validator("align")
    @classmethod
    def _known_alignment(cls, value: dict[str, int | str]) -> dict[str, int | str]:
        for kind, multiple in value.items():
            if kind not in ALIGN_KINDS:
                raise ValueError(unknown("unit kind", kind, ALIGN_KINDS))
            if multiple == "kv_group" and kind != "attention_head":
                raise ValueError(f"{kind}: kv_group applies to attention_head; give {kind} an integer multiple")
            if isinstance(multiple, int) and multiple < 1:
                raise ValueError(f"{kind}: multiples must be >= 1 (got {multiple})")
        return value

    def multiples(self, kinds: list[str] | tuple[str, ...]) -> dict[str, int]:
        """The alignment of these unit kinds as ``round_to`` multiples (kv_group: 1, the GQA rule already applies)."""
        return {kind: 1 if m == "kv_group" else m for kind, m in self.align.items() if kind in kinds}

    @property
    def part(self) -> str:
        """The ``params_by_part`` entry the ratio is of (``total`` for ``of: model``)."""
        return TARGET_PART[self.of]

    def kept_limit(self, dense: dict[str, int]) -> int:
        """Parameters of the target's part the finished model may keep."""
        return round((1.0 - self.ratio) * dense[self.part])

    def achieved(self, dense: dict[str, int], now: dict[str, int]) -> float:
        return 1.0 - now[self.part] / dense[self.part]

    def met(self, achieved: float) -> bool:
        return abs(achieved - self.ratio) <= self.tolerance + 1e-12


class StageSpec(Strict):
    stage: str
    args: dict[str, Any] = Field(default_factory=dict)
    _parsed: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _known_stage_and_args(self) -> StageSpec:
        try:
            definition = stage_def(self.stage)
        except KeyError:
            raise ValueError(unknown("stage", self.stage, stage_names())) from None
        try:
            self.args = definition.args.model_validate(self.args).model_dump()
        except ValidationError as error:
            raise ValueError(format_validation_error(error, prefix="args")) from None
        self._parsed = definition.args.model_validate(self.args)  # parsed once, as the recipe's mapping reads
        return self

    def parsed_args(self) -> StageArgs:
        """The stage's typed arguments (parsed once, when the recipe was validated)."""
        return self._parsed


class SequentialSpec(Strict):
    sequential: list[StageSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _layer_stages_only(self) -> SequentialSpec:
        for child in self.sequential:
            if stage_def(child.stage).scope != "layer":
                raise ValueError(f"stage '{child.stage}' works on the whole model and cannot run inside sequential")
        return self


def _stage_kind(value: Any) -> str:
    """The union's tag: of a raw mapping when parsing, of the model itself when serialising."""
    if isinstance(value, SequentialSpec) or (isinstance(value, dict) and "sequential" in value):
        return "sequential"
    return "stage"


StageItem = Annotated[
    Annotated[StageSpec, Tag("stage")] | Annotated[SequentialSpec, Tag("sequential")],
    Discriminator(_stage_kind),
]


RUN_OWN_NAMES = ("model", "report.json", "report.md")
"""What a run writes at the top of its output folder; an ``export:`` path never goes there."""


class ExportItem(Strict):
    """One export of the saved model (``slimkit export``), written inside the run's output folder."""

    format: Literal["gguf", "hf"] = "gguf"
    """gguf: a llama.cpp file (llama architecture, or deci for per-layer widths); hf: a plain Hugging Face folder."""
    type: Literal["f32", "f16", "bf16", "q8_0"] | None = None
    """GGUF weight type (default f16); not allowed with hf."""
    path: str | None = None
    """Where, relative to the output folder (default ``export/model-<type>.gguf`` or ``export/hf``)."""

    @model_validator(mode="after")
    def _check(self) -> ExportItem:
        if self.format == "hf" and self.type is not None:
            raise ValueError("type applies to format gguf only")
        if self.path is not None:
            parts = PurePosixPath(self.path).parts
            if not parts or self.path.startswith(("/", "\\")) or ".." in parts or ":" in self.path:
                raise ValueError(f"path '{self.path}' must be a relative path inside the output folder")
            if "\x00" in self.path or any(len(part.encode()) > 255 for part in parts):
                raise ValueError(f"path {self.path[:60]!r} holds a NUL byte or a name longer than 255 bytes")
            if parts[0] in RUN_OWN_NAMES:
                raise ValueError(
                    f"path '{self.path}' is in the run's own {parts[0]}; choose a path outside it (e.g. export/...)"
                )
        return self

    def target(self) -> str:
        if self.path is not None:
            return self.path
        return f"export/model-{self.type or 'f16'}.gguf" if self.format == "gguf" else "export/hf"


DeviceName = Annotated[str, AfterValidator(lambda name: _as_value_error(check_device_name, name))]
"""auto, cpu, cuda or cuda:N (checked by :func:`~slimkit.primitives.device.placement.check_device_name`)."""
DtypeName = Annotated[str, AfterValidator(lambda name: _as_value_error(check_dtype_name, name))]
"""auto, float32, bfloat16 or float16 (checked by :func:`~slimkit.primitives.device.placement.check_dtype_name`)."""
SizeText = Annotated[str, AfterValidator(lambda value: _as_value_error(parse_size, value))]
"""A memory size such as 20GiB or 512MB (checked by :func:`~slimkit.primitives.device.placement.parse_size`)."""


class ModelConfig(Strict):
    """The model to compress and where it runs. A bare string in a recipe (``model: smollm2-135m``) is
    shorthand for ``{source: smollm2-135m}``."""

    source: str = "smollm2-135m"
    """A named source (``slimkit sources``: smollm2-135m, minilm-l6) or a local Hugging Face folder."""
    device: DeviceName = "auto"
    """auto (CUDA when available, else CPU), cpu, cuda or cuda:N."""
    dtype: DtypeName = "auto"
    """Weights' dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16. Statistics and
    decompositions are computed in float32/float64 whatever this is."""
    save_dtype: str | None = None
    """Dtype of the saved weights (default: the model's dtype)."""
    max_memory: str | int | None = None
    """Memory the weights may use on the compute device (e.g. 20GiB); layers that do not fit are offloaded by
    accelerate (to CPU memory with CUDA, else to disk) and brought onto the device one at a time. Only layer
    stages (``sequential``, ``prune_layer``) run on an offloaded model."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"source": data} if isinstance(data, str) else data

    @field_validator("save_dtype")
    @classmethod
    def _known_save_dtype(cls, name: str | None) -> str | None:
        if name is None:
            return None
        if name == "auto":
            raise ValueError("use a dtype (float32, bfloat16, float16) or leave save_dtype unset")
        return _as_value_error(check_dtype_name, name)

    @field_validator("max_memory", mode="before")
    @classmethod
    def _finite_size(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):  # one message, not one per union member
            raise ValueError(f"must be a finite number, got {value!r}")
        return value

    @field_validator("max_memory")
    @classmethod
    def _size(cls, value: str | int | None) -> str | int | None:
        if value is not None:
            _as_value_error(parse_size, value)
        return value


def _as_value_error(check: Any, value: Any) -> Any:
    """Run a ``check_*`` that raises SlimkitError as pydantic expects (ValueError, message without field)."""
    try:
        check(value)
    except SlimkitError as error:
        raise ValueError(str(error).partition(": ")[2]) from None
    return value


class Recipe(Strict):
    name: str
    description: str = ""
    paper: str | None = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: str | None = None
    """A GLUE task (sst2, mrpc, rte, stsb): the model becomes a sequence classifier for it (see above)."""
    seed: int = Field(0, ge=0, lt=2**64)
    """Seeds torch's generators, which take 64-bit seeds."""
    calibration: CalibrationConfig | None = None
    target: Target
    stages: list[StageItem] = Field(min_length=1)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: list[ExportItem] = Field(default_factory=list)
    """Exports of the saved model (a mapping or a list of them): GGUF for llama.cpp, a plain Hugging Face folder."""

    @field_validator("export", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _distinct_exports(self) -> Recipe:
        targets = [item.target() for item in self.export]
        if len(set(targets)) != len(targets):
            raise ValueError(f"export: two exports write the same path ({', '.join(targets)}); give each a path")
        return self

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str | None) -> str | None:
        return name if name is None else check_glue_task(name)

    _source: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_source(cls, data: Any, handler: Any) -> Recipe:
        recipe = handler(data)
        if isinstance(data, dict) and recipe._source is None:
            recipe._source = copy.deepcopy(data)
        return recipe

    @classmethod
    def from_yaml(cls, name_or_file: str | os.PathLike | bytes, overrides: list[str] | None = None) -> Recipe:
        """A bundled recipe name or a YAML file (``str``, ``os.PathLike`` or ``bytes``), with a list of
        ``dotted.path=value`` overrides; a bad recipe (or a bare string for ``overrides``) raises
        :class:`~slimkit.primitives.errors.SlimkitError` with the field path."""
        from slimkit.primitives.io.paths import as_names, path_text
        from slimkit.recipes.loading import load_recipe

        return load_recipe(path_text(name_or_file, "name_or_file"), as_names(overrides, "overrides"))[0]

    def source(self) -> dict[str, Any]:
        """The mapping the recipe was built from (what is saved as ``recipe.yaml`` beside the weights)."""
        if self._source is not None:
            return copy.deepcopy(self._source)
        return self.model_dump(mode="json", exclude_unset=True)

    @model_validator(mode="after")
    def _composition(self) -> Recipe:
        """Budgets and module types across stages, checked before anything runs."""
        solver: str | None = None
        lowrank: dict[str, str] = {}
        seen: dict[str, str] = {}
        for index, item in enumerate(self.stages):
            children = item.sequential if isinstance(item, SequentialSpec) else [item]
            block_solver: str | None = None
            rewritten: dict[str, str] = {}
            for child_index, spec in enumerate(children):
                where = f"stages.{index}" + (f".sequential.{child_index}" if isinstance(item, SequentialSpec) else "")
                definition = stage_def(spec.stage)
                if definition.once and spec.stage in seen:
                    raise ValueError(
                        f"{where}: stage '{spec.stage}' may run once per recipe ({definition.once}); "
                        f"it already runs at {seen[spec.stage]}"
                    )
                seen.setdefault(spec.stage, where)
                args = spec.parsed_args()
                mode = offered(args, SharesTarget).budget()
                projections = offered(args, ChangesProjections)
                if mode in ("solve", "layer") and solver is not None:
                    raise ValueError(
                        f"{where}: stage '{spec.stage}' derives its share from the target, but {solver} before it "
                        "already removes all that is left of it; give one of them an explicit ratio"
                    )
                if mode == "solve":
                    if block_solver is not None:
                        raise ValueError(
                            f"{where}: stage '{spec.stage}' and {block_solver} both solve the rest of the target "
                            "in one block; give one of them an explicit ratio"
                        )
                    block_solver = f"{where} ('{spec.stage}')"
                clash = sorted(projections.touches() & set(lowrank))
                if clash:
                    raise ValueError(
                        f"{where}: stage '{spec.stage}' needs plain Linear {', '.join(clash)} projections, but "
                        f"{lowrank[clash[0]]} replaced them by low-rank pairs; run it before that stage or leave those "
                        "projections out"
                    )
                for role in projections.makes_lowrank():
                    lowrank.setdefault(role, f"{where} ('{spec.stage}')")
                rewrites = sorted(projections.refits() & set(rewritten))
                if rewrites:
                    raise ValueError(
                        f"{where}: stage '{spec.stage}' refits {', '.join(rewrites)} from the dense weights, but "
                        f"{rewritten[rewrites[0]]} already rewrote its kept columns (OBS update); leave "
                        f"{', '.join(rewrites)} out of its roles, or remove units with prune_layer"
                    )
                for role in projections.rewrites_kept():
                    rewritten.setdefault(role, f"{where} ('{spec.stage}')")
            solver = solver or block_solver
        modes = [offered(s.parsed_args(), SharesTarget).budget() for s in self.flat_stages()]
        if self.target.ratio > 0 and all(mode == "none" for mode in modes):
            raise ValueError(
                f"target.ratio: {self.target.ratio:g} of {self.target.of} is to be removed, but no stage removes "
                "parameters; add a pruning, low-rank or projection stage, or set target.ratio: 0"
            )
        return self

    @model_validator(mode="after")
    def _stage_recipe_checks(self) -> Recipe:
        """Each stage's own checks against the rest of the recipe (:meth:`ChecksRecipe.check_recipe`: a selection
        stage's ``round_to`` against ``target.align``, a search's held-out batches against the calibration set)."""
        for where, spec in self.stage_places():
            offered(spec.parsed_args(), ChecksRecipe).check_recipe(self, where)
        return self

    def stage_places(self) -> list[tuple[str, StageSpec]]:
        """``(stages.I[.sequential.J], spec)`` of every stage, in order."""
        places = []
        for index, item in enumerate(self.stages):
            if isinstance(item, SequentialSpec):
                places += [(f"stages.{index}.sequential.{j}", spec) for j, spec in enumerate(item.sequential)]
            else:
                places.append((f"stages.{index}", item))
        return places

    @model_validator(mode="after")
    def _task_rules(self) -> Recipe:
        for index, spec in enumerate(self.flat_stages()):
            if self.task is None and offered(spec.parsed_args(), ReadsData).needs_task():
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
        return any(offered(s.parsed_args(), ReadsData).needs_calibration() for s in self.flat_stages())

    def calibration_config(self) -> CalibrationConfig | None:
        """Calibration settings when a stage needs them (the defaults if the recipe gives none)."""
        if not self.needs_calibration():
            return None
        config = self.calibration or CalibrationConfig()
        if config.dataset == "glue":
            return config.model_copy(update={"dataset": f"glue-{self.task}"})
        return config
