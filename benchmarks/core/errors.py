"""The benchmarks' one-line error.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

from slimkit.primitives.errors import SlimkitError


class BenchError(SlimkitError):
    """A bad option, input file or name: printed as one ``error: ...`` line with exit status 2, as the ``slimkit``
    CLI prints its own input errors."""
