"""slimkit: small, composable structured-compression primitives for transformer language models.

Public API: :func:`load` and :func:`save` for compressed models, :func:`load_source` for named
model sources (``smollm2-135m``, ``minilm-l6`` or a local Hugging Face folder).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# transformers' own bars (loading, writing shards, GGUF de-quantising) are noise next to slimkit's.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

__version__ = "0.1.0"

__all__ = ["__version__", "load", "load_source", "save"]


def __getattr__(name: str):
    # Lazy: `import slimkit` stays cheap (no torch/transformers import) until the API is used.
    if name in ("load", "save"):
        from slimkit.primitives import io

        return getattr(io, name)
    if name == "load_source":
        from slimkit.primitives.sources import load_source

        return load_source
    raise AttributeError(f"module 'slimkit' has no attribute {name!r}")
