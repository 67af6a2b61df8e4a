"""User-facing errors.

Anything a user can get wrong (a recipe field, a model source, a data file, an output folder)
raises :class:`SlimkitError` with one line that names the problem, the field and what is allowed.
The CLI prints that line and exits non-zero; it never shows a traceback for these.

A name that is not one of a fixed set (a stage, a dataset, a recipe field, a model source) is
reported with :func:`unknown`: the name, the closest allowed name when one is close enough
(:func:`closest`, difflib's ratio >= 0.6, case-insensitive), then every allowed name. A pydantic validation
error (a settings block, a grid file) becomes that line with :func:`format_validation_error`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError


class SlimkitError(Exception):
    """A problem with the user's input, reported as one readable line."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def closest(name: str, allowed: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The allowed name closest to ``name``, or None when none is close enough.

    Closeness is :func:`difflib.get_close_matches` on lower-cased names (``cutoff`` on its ratio);
    ``name`` itself is never returned.
    """
    by_lower: dict[str, str] = {}
    for candidate in allowed:
        if candidate != name:
            by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[matches[0]] if matches else None


def did_you_mean(name: str, allowed: Iterable[str], cutoff: float = 0.6) -> str:
    """``"; did you mean 'x'?"`` for the allowed name closest to ``name`` (:func:`closest`), or ``""``."""
    match = closest(name, allowed, cutoff)
    return f"; did you mean '{match}'?" if match else ""


def unknown(
    kind: str,
    name: str,
    allowed: Iterable[str],
    *,
    label: str = "allowed",
    tail: str = "",
    suggest: Iterable[str] | None = None,
) -> str:
    """``"unknown {kind} '{name}'; did you mean 'x'? {label}: a, b, c{tail}"`` (no suggestion when none is close).

    ``suggest``: the names a suggestion may come from, when not all of ``allowed``.

    >>> unknown("stage", "prnue", ["lora", "prune"])
    "unknown stage 'prnue'; did you mean 'prune'? allowed: lora, prune"
    >>> unknown("stage", "heads", ["lora", "prune"])
    "unknown stage 'heads'; allowed: lora, prune"
    """
    names = list(allowed)
    hint = did_you_mean(name, names if suggest is None else suggest)
    separator = f"{hint} " if hint else "; "
    return f"unknown {kind} '{name}'{separator}{label}: {', '.join(names)}{tail}"


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
        if item["type"] == "finite_number":  # inf or NaN: say so, not "should be less than 1"
            message = f"must be a finite number, got {item['input']!r}"
        problems.append(f"{path}: {message}" if path else message)
    return "; ".join(problems)
