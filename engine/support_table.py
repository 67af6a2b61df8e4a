"""The support table: what each stage does on each architecture, generated from the code.

Rows are the architectures of :data:`~slimkit.primitives.arch.spec.ARCH_SPECS`; the first table's columns are the
operations of :mod:`slimkit.primitives.arch.capabilities` (works, or the architectural reason it is refused), the
second's the registered stages: a stage works on an architecture unless one of the operations its arguments
declare (``StageArgs.operations``) is refused there. A stage whose operations follow an argument (``groups``,
``kinds``) lists the choices refused. ``slimkit stage support`` prints it; docs/methods/architectures.md holds a
copy that a test keeps equal to it.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from slimkit.engine.capabilities import ChecksModel
from slimkit.primitives.arch.capabilities import OPERATIONS, conditional, refusal
from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec
from slimkit.recipes.catalogue import stage_def, stage_names
from slimkit.recipes.stage_args import offered

CHOICE_FIELDS = ("groups", "kinds")
"""Argument fields whose values are operations (unit kinds), so the stage's support depends on them."""

ENCODER_STAGES_NOTE = "encoder stages (a GLUE task model or a post-norm encoder; decoders are refused when loaded)"


def _choices(args: type[BaseModel]) -> tuple[str, list[str]] | None:
    """``(field, its allowed values)`` when the stage's operations follow an argument, else None."""
    for field in CHOICE_FIELDS:
        info = args.model_fields.get(field)
        if info is None:
            continue
        (item,) = typing.get_args(info.annotation) or (None,)
        values = [v for v in typing.get_args(item) if isinstance(v, str) and v in OPERATIONS]
        if values:
            return field, values
    return None


class Reasons:
    """The distinct refusal reasons of a table, numbered in order of first use (cells cite ``[n]``)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def cite(self, reason: str) -> str:
        if reason not in self.texts:
            self.texts.append(reason)
        return f"[{self.texts.index(reason) + 1}]"

    def legend(self) -> list[str]:
        return [f"{i}. {text}" for i, text in enumerate(self.texts, start=1)]


def refused_cell(reason: str, reasons: Reasons) -> str:
    """``refused [n]``, or ``refused where [n]`` for a refusal that holds only where the config says so."""
    return f"refused {'where ' if conditional(reason) else ''}{reasons.cite(reason)}"


def stage_cell(name: str, spec: ArchSpec, reasons: Reasons) -> str:
    """``works``, ``refused [n]`` or, for a stage whose operations follow its arguments, the choices refused."""
    definition = stage_def(name)
    args = definition.args.model_construct()  # unvalidated defaults: only the declared operations are read
    choices = _choices(definition.args)
    if choices is not None:
        field, values = choices
        refused = [f"{v} {reasons.cite(r)}" for v in values if (r := refusal(spec, v)) is not None]
        return "works" if not refused else f"works; {field} {', '.join(refused)} refused"
    for operation in sorted(offered(args, ChecksModel).operations()):
        reason = refusal(spec, operation)
        if reason is not None:
            return refused_cell(reason, reasons)
    return "works"


def decoder_stages() -> list[str]:
    """The registered stages that act on decoders (the encoder and GLUE stages aside)."""
    return [n for n in stage_names() if not encoder_only(stage_def(n).args)]


def encoder_only(args: type) -> bool:
    """Whether a stage with these arguments acts on encoders only (:attr:`ChecksModel.encoder_only`)."""
    return issubclass(args, ChecksModel) and args.encoder_only


def architectures() -> list[str]:
    """The decoder architectures (rows of both tables)."""
    return sorted(t for t, spec in ARCH_SPECS.items() if not spec.encoder)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(["architecture", *columns]), _row(["---"] * (1 + len(columns))), *map(_row, rows)]


def operation_table(reasons: Reasons) -> list[str]:
    """Architecture x operation: ``works`` or ``refused [n]``."""
    rows = []
    for model_type in architectures():
        cells = []
        for operation in OPERATIONS:
            reason = refusal(ARCH_SPECS[model_type], operation)
            cells.append("works" if reason is None else refused_cell(reason, reasons))
        rows.append([model_type, *cells])
    return _table(list(OPERATIONS), rows)


def stage_table(reasons: Reasons) -> list[str]:
    """Architecture x decoder stage."""
    stages = decoder_stages()
    rows = [[t, *(stage_cell(name, ARCH_SPECS[t], reasons) for name in stages)] for t in architectures()]
    return _table(stages, rows)


def support_markdown() -> str:
    """Both tables, the numbered reasons and the stages left out: what ``slimkit stage support`` prints and the
    docs hold."""
    reasons = Reasons()
    operations = operation_table(reasons)
    stages = stage_table(reasons)
    encoder = [n for n in stage_names() if n not in decoder_stages()]
    labels = [f"`{op}`: {label}" for op, label in OPERATIONS.items()]
    return "\n".join(
        [
            "Operations (what the stages change): " + "; ".join(labels) + ".",
            "",
            *operations,
            "",
            *stages,
            "",
            "Config constants the forward applies, which width changes keep (where one matters to a stage, its refusal "
            "names it): "
            + "; ".join(
                f"{t}: {', '.join(ARCH_SPECS[t].scalar_keys)}" for t in architectures() if ARCH_SPECS[t].scalar_keys
            )
            + ".",
            "",
            "Why refused (the one-line error names the operation and the architecture):",
            "",
            *reasons.legend(),
            "",
            f"Not listed: the {ENCODER_STAGES_NOTE}: {', '.join(encoder)}.",
        ]
    )


__all__ = [
    "Reasons",
    "architectures",
    "decoder_stages",
    "operation_table",
    "refused_cell",
    "stage_cell",
    "stage_table",
    "support_markdown",
]
