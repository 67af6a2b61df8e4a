"""User-facing errors.

Anything a user can get wrong (a recipe field, a model source, a data file, an output folder)
raises :class:`SlimkitError` with one line that names the problem, the field and what is allowed.
The CLI prints that line and exits non-zero; it never shows a traceback for these.
"""

from __future__ import annotations


class SlimkitError(Exception):
    """A problem with the user's input, reported as one readable line."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
