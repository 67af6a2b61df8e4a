"""The evaluation settings, declared once: :class:`EvalConfig` (a recipe's ``eval`` section, ``slimkit eval``'s
options, :func:`slimkit.evaluate`'s arguments) and its parts, with the checks of the names they take.

:mod:`slimkit.primitives.evaluate.run` reads these; the recipe schema (:mod:`slimkit.recipes.schema`) embeds
:class:`EvalConfig` as its ``eval`` field; :func:`eval_options` builds one from flat options.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, ValidationError, field_validator

from slimkit.primitives.datasets.textdata import CORPORA
from slimkit.primitives.errors import SlimkitError, format_validation_error, unknown
from slimkit.primitives.settings import Strict

PERPLEXITY_SEQ_LEN = 512
"""Tokens per perplexity window, unless a setting says otherwise."""
PERPLEXITY_MAX_TOKENS = 16384
"""Test-set tokens perplexity reads, unless a setting says otherwise (None: the whole test set)."""
PERPLEXITY_BATCH_SIZE = 4
"""Perplexity windows per forward pass."""
ZEROSHOT_BATCH_SIZE = 8
"""lm-eval's requests per forward pass."""
GLUE_BATCH_SIZE = 32
"""GLUE dev examples per forward pass."""
GLUE_MAX_LENGTH = 128
"""Tokens a GLUE example is cut to."""


def check_corpus(name: str) -> str:
    """``name`` if it is a known text corpus; ``ValueError`` (one line, the closest name and all of them) otherwise."""
    if name not in CORPORA:
        raise ValueError(unknown("dataset", name, CORPORA))
    return name


def check_zeroshot_task(name: str) -> str:
    """``name`` if it is a known zero-shot task; ``ValueError`` otherwise."""
    from slimkit.primitives.evaluate.zeroshot import ZEROSHOT_TASKS

    if name not in ZEROSHOT_TASKS:
        raise ValueError(unknown("zero-shot task", name, ZEROSHOT_TASKS))
    return name


def check_glue_task(name: str) -> str:
    """``name`` if it is a known GLUE task; ``ValueError`` otherwise."""
    from slimkit.primitives.datasets.gluedata import GLUE_TASKS

    if name not in GLUE_TASKS:
        raise ValueError(unknown("GLUE task", name, GLUE_TASKS))
    return name


class PerplexityEval(Strict):
    datasets: list[str] = Field(default_factory=lambda: ["wikitext2"])
    seq_len: int = Field(PERPLEXITY_SEQ_LEN, ge=2)
    max_tokens: int | None = Field(PERPLEXITY_MAX_TOKENS, ge=2)
    batch_size: int = Field(PERPLEXITY_BATCH_SIZE, ge=1)

    @field_validator("datasets")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        return [check_corpus(n) for n in names]


class ZeroshotEval(Strict):
    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, ge=1)
    batch_size: int = Field(ZEROSHOT_BATCH_SIZE, ge=1)

    @field_validator("tasks")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        return [check_zeroshot_task(n) for n in names]


class GlueEval(Strict):
    task: str | None = None
    """A GLUE task; None: the recipe's ``task`` (else the task the model records, ``finetuning_task``)."""
    limit: int | None = Field(None, ge=1)
    """The first ``limit`` dev examples in file order (None: the whole dev split)."""
    batch_size: int = Field(GLUE_BATCH_SIZE, ge=1)
    max_length: int = Field(GLUE_MAX_LENGTH, ge=8)

    @field_validator("task")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return name if name is None else check_glue_task(name)


class EvalConfig(Strict):
    perplexity: PerplexityEval | None = Field(default_factory=PerplexityEval)
    zeroshot: ZeroshotEval | None = None
    speed: bool = False
    glue: GlueEval | None = None


def eval_options(
    origin: str,
    perplexity: Sequence[str] | None,
    zeroshot: Sequence[str] | None = None,
    limit: int | None = None,
    glue: str | None = None,
    speed: bool = False,
    seq_len: int = PERPLEXITY_SEQ_LEN,
    max_tokens: int | None = PERPLEXITY_MAX_TOKENS,
) -> EvalConfig:
    """An :class:`EvalConfig` from flat options (``slimkit eval``, :func:`slimkit.evaluate`); a bad value raises
    :class:`~slimkit.primitives.errors.SlimkitError` as ``origin: field.path: message``."""
    config = {
        "perplexity": {"datasets": list(perplexity), "seq_len": seq_len, "max_tokens": max_tokens}
        if perplexity
        else None,
        "zeroshot": {"tasks": list(zeroshot), "limit": limit} if zeroshot else None,
        "speed": speed,
        "glue": {"task": glue, "limit": limit} if glue else None,
    }
    try:
        return EvalConfig.model_validate(config)
    except ValidationError as error:
        raise SlimkitError(f"{origin}: {format_validation_error(error)}") from None


__all__ = [
    "GLUE_BATCH_SIZE",
    "GLUE_MAX_LENGTH",
    "PERPLEXITY_BATCH_SIZE",
    "PERPLEXITY_MAX_TOKENS",
    "PERPLEXITY_SEQ_LEN",
    "ZEROSHOT_BATCH_SIZE",
    "EvalConfig",
    "GlueEval",
    "PerplexityEval",
    "ZeroshotEval",
    "check_corpus",
    "check_glue_task",
    "check_zeroshot_task",
    "eval_options",
]
