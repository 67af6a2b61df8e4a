"""The run's report as typed contracts: :class:`RunReport` (``report.json``), :class:`StageReport` (one stage's entry),
:class:`LayerStats` (one layer's widths) and :class:`DenseComparison` (the dense model's metrics beside the run's).

``report.json`` is ``RunReport.as_json()``; readers load it with ``RunReport.model_validate_json``. A stage's entry is
flat in the file: its typed fields beside whatever else the stage recorded (:attr:`StageReport.details`), so the
keys a stage wrote stay where they were.
"""

from __future__ import annotations

import resource
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_serializer, model_validator

from slimkit.primitives.settings import Strict

MACS_SEQ_LEN = 128
"""The sequence length MACs are counted at."""


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class ReportModel(Strict):
    """A part of the report: an infinite or NaN value is accepted and stays one in ``report.json`` (``Infinity``,
    ``NaN``); unknown keys are ignored (a report written by newer code loads in older readers)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=True, ser_json_inf_nan="constants")


class Record(ReportModel):
    """A report section: unknown keys are kept (reports written by newer code load in older readers)."""

    model_config = ConfigDict(extra="allow")


class StageReport(ReportModel):
    """One stage's report: typed fields for what every consumer reads, ``details`` for the rest."""

    model_config = ConfigDict(extra="forbid")

    params_added: int | None = None
    """Parameters the stage added to the model (residual matrices of a PCA projection); None: it added none."""
    calibration_tokens: int | None = None
    """Calibration tokens the stage drew beyond the run's calibration set (CCE's fresh samples per iteration)."""
    training_tokens: int | None = None
    """Tokens a training stage (lora, distill, mask_train, ...) took gradient steps on."""
    seconds: float | None = None
    """The stage's own wall time, when it measures one."""
    details: dict[str, Any] = Field(default_factory=dict)
    """Everything else the stage recorded, under its own names."""

    TYPED: ClassVar[tuple[str, ...]] = ("params_added", "calibration_tokens", "training_tokens", "seconds")

    @model_validator(mode="before")
    @classmethod
    def _split_flat(cls, data: Any) -> Any:
        """A flat mapping (``report.json``'s form): typed keys to their fields, every other key to ``details``."""
        if isinstance(data, dict) and "details" not in data:
            return {
                **{key: data[key] for key in cls.TYPED if key in data},
                "details": {key: value for key, value in data.items() if key not in cls.TYPED},
            }
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler) -> dict[str, Any]:
        dumped = handler(self)
        details = dumped.pop("details")
        return {**details, **dumped}

    @classmethod
    def from_stage(cls, recorded: dict[str, Any], trains: bool, calibration_tokens: int) -> StageReport:
        """A stage's typed report from the mapping it recorded during the run.

        ``params_added``: its ``params_added`` or ``residual_params``; ``training_tokens``: its ``tokens`` when the
        stage ``trains``; ``calibration_tokens``: its ``calibration_tokens``, else one more calibration set of
        ``calibration_tokens`` per further distinct seed of its ``iterations`` (CCE draws fresh samples per
        iteration and records each iteration's seed)."""
        added = recorded.get("params_added", recorded.get("residual_params"))
        seconds = recorded.get("seconds")
        drawn = recorded.get("calibration_tokens")
        iterations = recorded.get("iterations")
        if drawn is None and isinstance(iterations, list) and calibration_tokens:
            seeds = {it["seed"] for it in iterations if isinstance(it, dict) and it.get("seed") is not None}
            drawn = max(len(seeds) - 1, 0) * calibration_tokens or None
        tokens = recorded.get("tokens") if trains else None
        typed = cls(
            params_added=added if isinstance(added, int) else None,
            calibration_tokens=drawn if isinstance(drawn, int) else None,
            training_tokens=tokens if isinstance(tokens, int) else None,
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
        )
        # a key the typed fields took is not repeated in the details (``residual_params`` and ``tokens`` stay)
        typed.details = {k: v for k, v in recorded.items() if k not in cls.TYPED or getattr(typed, k) is None}
        return typed


class LayerStats(Record):
    """One decoder layer's widths (``ModelView.layer_widths``); the MLP width is kept under the architecture's
    config name (``intermediate_size``, ``ffn_dim``, ...), so it is an extra field, as are a hybrid's mixer widths
    (whose layers without attention give no head counts: 0 here)."""

    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0

    @property
    def mlp_width(self) -> int | None:
        return next(iter((self.model_extra or {}).values()), None)


class LayerWidths(ReportModel):
    before: list[LayerStats]
    after: list[LayerStats]


class TargetOutcome(ReportModel):
    """The report's ``target``: wanted, achieved, tolerance, whether it is met, and each stage's share."""

    ratio: float
    of: str
    achieved: float
    tolerance: float
    strict: bool
    met: bool
    shares: dict[str, float]
    align: dict[str, int | str] = Field(default_factory=dict, exclude_if=lambda align: not align)
    """``target.align``: the kept-width multiples every pruning stage rounded to, by unit kind (left out when none)."""

    def missed_message(self) -> str:
        shares = ", ".join(f"{label} {share:.2%}" for label, share in self.shares.items())
        return (
            f"target missed: {self.ratio:.1%} of {self.of} wanted, {self.achieved:.2%} achieved "
            f"(tolerance {self.tolerance:.1%}); removed by stage: {shares or 'none'}. Nothing was written; "
            "adjust the stages' explicit ratios, or set target.strict: false to keep such a result"
        )


class ParamCounts(ReportModel):
    before: int
    after: int
    removed_ratio: float
    by_part_before: dict[str, int]
    by_part_after: dict[str, int]

    @property
    def removed(self) -> int:
        return self.before - self.after


class MacCounts(ReportModel):
    before: int
    after: int
    seq_len: int


class RunTimings(ReportModel):
    total: float
    stages: dict[str, float]

    def compress_seconds(self) -> float:
        """Calibration and the recipe's stages (labels ``0:prune``, ...): loading, saving and evaluation left out."""
        return sum(v for k, v in self.stages.items() if k == "calibration" or k[:1].isdigit())


class PlacementReport(Record):
    """Where the run computed (``Placement.describe``: device, dtype, GPU, memory budget) and what it used."""

    device: str
    dtype: str
    offloaded: bool = False
    peak_gpu_mb: float | None = None
    save_dtype: str | None = None


class StagePlanReport(ReportModel):
    """One stage's planned peak beside the weights (GiB): its total and its parts (gradient sums, activations, ...)."""

    stage: str
    total_gib: float
    parts_gib: dict[str, float]
    released_gib: float = 0.0
    """The model's weights the stage frees while its parts are held (a student trained whole)."""


class MemoryPlanReport(ReportModel):
    """The memory plan the preflight checked before loading
    (:class:`~slimkit.primitives.device.memory_model.MemoryPlan`): the weights, each stage's extra, and the peak
    (weights plus the largest stage), in GiB."""

    weights_gib: float
    peak_gib: float
    peak_stage: str | None
    stages: list[StagePlanReport]


class DenseComparison(ReportModel):
    """The dense model's metrics under the same evaluation settings, computed once and cached."""

    metrics: dict[str, float]
    cached: bool
    """Read from the slimkit cache folder (True) or measured in this run (False)."""

    def ratios(self, metrics: dict[str, float]) -> dict[str, float]:
        """The run's metric over the dense one, for each metric both have (perplexity: >1 is worse)."""
        return {k: v / self.metrics[k] for k, v in metrics.items() if self.metrics.get(k)}


class RunReport(ReportModel):
    """``report.json``: what a run did, measured and wrote."""

    recipe: str
    model: str
    seed: int
    target: TargetOutcome
    params: ParamCounts
    macs: MacCounts
    timings_s: RunTimings
    peak_rss_mb: float
    placement: PlacementReport
    metrics: dict[str, float]
    evaluation: dict[str, Any]
    calibration: dict[str, Any] | None
    stages: dict[str, StageReport]
    layers: LayerWidths
    notes: list[str]
    versions: dict[str, Any]
    dense: DenseComparison | None = None
    memory_plan: MemoryPlanReport | None = None
    loaders: list[dict[str, str]] | None = None
    export: list[dict[str, Any]] | None = None

    def as_json(self) -> dict[str, Any]:
        """The mapping ``report.json`` holds."""
        return self.model_dump(mode="json")

    def stage_sum(self, field: str, names: tuple[str, ...] | None = None) -> int | None:
        """Sum of an integer :class:`StageReport` field over the stages (only those named, when ``names`` is given);
        None when no stage states it."""
        values = [
            getattr(report, field)
            for name, report in self.stages.items()
            if (names is None or name in names) and getattr(report, field) is not None
        ]
        return sum(values) if values else None

    def comparison_lines(self) -> list[str]:
        """``WikiText-2 61.95 vs dense 28.14 (2.20x)``, one line per metric (with the dense value when known)."""
        dense = self.dense.metrics if self.dense is not None else {}
        lines = []
        for key, value in self.metrics.items():
            line = f"{metric_label(key)} {value:.4g}"
            if dense.get(key):
                line += f" vs dense {dense[key]:.4g} ({value / dense[key]:.2f}x)"
            lines.append(line)
        return lines


METRIC_NAMES = {"wikitext2": "WikiText-2", "ptb": "PTB", "c4": "C4"}


def metric_label(key: str) -> str:
    """A metric key as a reader names it: ``wikitext2_ppl`` is ``WikiText-2``, ``piqa_acc`` is ``piqa acc``."""
    if key.endswith("_ppl"):
        return METRIC_NAMES.get(key.removesuffix("_ppl"), key.removesuffix("_ppl"))
    return key.replace("_", " ")
