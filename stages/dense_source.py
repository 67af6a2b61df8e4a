"""The dense model a stage compares against: the recipe's model source loaded again.

``distill`` trains against it (its teacher) and ``reconstruct`` at the top level refits against its layers. Both
reload the model the run started from (for a model slimkit compressed earlier, the dense model it came from:
:func:`~slimkit.primitives.io.model_sources.dense_of`) with
:func:`slimkit.primitives.io.model_sources.load_source`, in the compressed model's dtype, on the device the caller
names (``distill``: the student's; ``reconstruct``: the CPU). A model given in memory
(``slimkit.run(recipe, model=...)``) has no source to reload and is refused in one line, as is a source that cannot
be loaded (out of memory, a folder changed since the run started), naming the memory the dense weights need (dense
parameter count x the dtype's bytes). The caller frees the model (:func:`release_memory`) when it is done.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch
from torch import nn

from slimkit.engine.context import Context
from slimkit.primitives.device.placement import dtype_name, format_size
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.model_sources import dense_of, load_source


@dataclass(frozen=True)
class ReloadedDense:
    """A reloaded dense model and what a report records about it."""

    model: nn.Module
    source: str
    load_seconds: float
    weights: str
    """The dense weights' size in the model's dtype (``format_size``: ``"540.4 MB"``)."""


def reload_dense(
    ctx: Context,
    stage: str,
    *,
    what: str,
    device: str | None,
    why: str,
    instead: str,
    holds: str,
    max_memory: str | None = None,
):
    """The recipe's model source loaded again on ``device`` (None: the compressed model's) in the compressed
    model's dtype, as a :class:`ReloadedDense`; with ``max_memory``, offloaded (at most that much of its weights on
    ``device``, the rest in CPU memory or on disk, moved in layer by layer for each forward).

    The refusals are one line each: ``"{stage}: {why} reloads the recipe's model source, but this run compresses a
    model given in memory (nothing to reload); run the recipe from its model source, or {instead}"``, and
    ``"{stage}: cannot load the {what} from NAME on DEVICE in DTYPE (PROBLEM); {holds}"`` with ``{need}`` in
    ``holds`` replaced by the dense weights' size."""
    source = dense_of(ctx.source)
    path = source.get("path")
    if ctx.source.get("path") is None or path is None:
        raise SlimkitError(
            f"{stage}: {why} reloads the recipe's model source, but this run compresses a model given in memory "
            f"(nothing to reload); run the recipe from its model source, or {instead}"
        )
    first = next(ctx.model.parameters())
    device = device or str(first.device)
    dtype = dtype_name(first.dtype)
    dense = ctx.params_before.get("total") or sum(p.numel() for p in ctx.model.parameters())
    need = format_size(dense * first.element_size())
    started = time.perf_counter()
    try:
        model, _tokenizer, _info = load_source(path, device=device, dtype=dtype, max_memory=max_memory)
    except (SlimkitError, RuntimeError, OSError) as error:  # torch.OutOfMemoryError is a RuntimeError
        problem = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SlimkitError(
            f"{stage}: cannot load the {what} from {source.get('name')} on {device} in {dtype} ({problem}); "
            + holds.format(need=need)
        ) from None
    return ReloadedDense(model, str(source.get("name")), time.perf_counter() - started, need)


def release_memory(cuda: bool) -> None:
    """Return a freed model's memory (collect now; give CUDA's cached blocks back)."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
