"""BlockPruner's iterative search: remove, one at a time, the block whose removal raises the calibration loss least.

Method note: docs/methods/block-removal.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from slimkit.primitives.arch import BlockKind, ModelView
from slimkit.primitives.arch.output_logits import output_logits, output_steps
from slimkit.primitives.blocks.remove import (
    Block,
    block_params,
    check_removable,
    kept_per_kind,
    present_blocks,
    remove_block,
    without_block,
)
from slimkit.primitives.calibration.capture import capture_layer_inputs
from slimkit.primitives.errors import SlimkitError


class LayerLoss:
    """Mean next-token loss of ``model`` on ``batches``, computable from any layer on.

    ``inputs[i]`` holds layer ``i``'s input for every batch in the model as it is now; :meth:`refresh` recomputes
    them after layer ``i`` changed; :meth:`from_layer` runs layers ``i`` onward, the final norm and the head with the
    family's output transform (the vocabulary projection ``chunk_tokens`` rows at a time, so full logits are never
    held)."""

    def __init__(self, model: nn.Module, batches: Sequence[torch.Tensor], chunk_tokens: int = 512) -> None:
        if not batches:
            raise SlimkitError("the block search needs calibration batches")
        self.view = ModelView(model)
        if self.view.head is None:
            raise SlimkitError("the block search measures next-token loss and needs a model with an LM head")
        self.chunk_tokens = chunk_tokens
        self.model = model
        self.steps = output_steps(model)
        with torch.no_grad():
            first = capture_layer_inputs(model, self.view.layer_list[0], batches)
        self.kwargs = first.kwargs
        self.targets = [batch[:, 1:].reshape(-1) for batch in batches]
        self.tokens = sum(t.numel() for t in self.targets)
        self.inputs: list[list[torch.Tensor]] = [first.hidden]
        self.refresh(0)

    def _run(self, start: int, stop: int, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        for module in self.view.layer_list[start:stop]:
            out = module(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def refresh(self, start: int) -> None:
        """Recompute the inputs of layers ``start + 1`` onward from layer ``start``'s."""
        del self.inputs[start + 1 :]
        with torch.no_grad():
            for index in range(start, self.view.num_layers):
                previous = self.inputs[index]
                self.inputs.append(
                    [self._run(index, index + 1, h, kw) for h, kw in zip(previous, self.kwargs, strict=True)]
                )

    def _summed_nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> float:
        norm = self.view.final_norm
        if norm is not None:
            hidden = norm.module(hidden)
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        targets = targets.to(hidden.device)
        total = 0.0
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            logits = output_logits(self.model, hidden[start : start + self.chunk_tokens], self.steps).float()
            total += F.cross_entropy(logits, targets[start : start + self.chunk_tokens], reduction="sum").item()
        return total

    def from_layer(self, start: int) -> float:
        """The mean loss when layers ``start`` onward run on the kept inputs of layer ``start``."""
        total = 0.0
        with torch.no_grad():
            for hidden, kwargs, targets in zip(self.inputs[start], self.kwargs, self.targets, strict=True):
                total += self._summed_nll(self._run(start, self.view.num_layers, hidden, kwargs), targets)
        return total / self.tokens


@dataclass(frozen=True)
class SearchStep:
    """One removal: the block, the calibration loss once it (and every earlier one) is gone, its parameters (in the
    search's ``part``)."""

    block: Block
    loss: float
    params: int
    tried: int
    """Candidates whose loss this step measured."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclass
class SearchResult:
    loss_before: float
    """The calibration loss of the model as the search found it."""
    steps: list[SearchStep] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    """Calibration tokens each loss was measured on."""

    @property
    def removed_params(self) -> int:
        return sum(step.params for step in self.steps)


Progress = Callable[[SearchStep], None]


def _candidates(
    model: nn.Module, kinds: Sequence[BlockKind], layers: Sequence[int], room: int | None, part: str
) -> list[Block]:
    """Present blocks of ``kinds`` in ``layers`` that keep one block of each kind and, with a ``room``, hold some of
    it: more than 0 and at most ``room`` parameters of ``part`` (a block outside the part does not count)."""
    kept = kept_per_kind(model)
    blocks = [b for b in present_blocks(model, kinds, layers) if kept[b.kind] > 1]
    return [b for b in blocks if room is None or 0 < block_params(model, b, part) <= room]


def search_blocks(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    kinds: Sequence[BlockKind],
    layers: Sequence[int],
    *,
    count: int | None = None,
    limit: int | None = None,
    enough: int | None = None,
    part: str = "total",
    progress: Progress | None = None,
) -> SearchResult:
    """Remove blocks of ``kinds`` in ``layers`` from ``model`` one at a time, each the one whose removal gives the
    lowest calibration loss on ``batches``; stop after ``count`` blocks, or (with ``limit``) when no candidate fits
    in what is left of ``limit`` parameters or once ``enough`` parameters are gone. Parameters are counted in
    ``part`` (:func:`~.remove.block_params`). Returns the steps in order."""
    if (count is None) == (limit is None):
        raise ValueError("search_blocks: give count or limit")
    check_removable(model)
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        loss = LayerLoss(model, batches)
        result = SearchResult(loss_before=loss.from_layer(0), tokens=loss.tokens)
        while count is None or len(result.steps) < count:
            removed = result.removed_params
            if enough is not None and removed >= enough:
                break
            candidates = _candidates(model, kinds, layers, None if limit is None else limit - removed, part)
            if not candidates:
                if count is not None:
                    raise SlimkitError(
                        f"the block search found {len(result.steps)} of {count} blocks to remove: no other block of "
                        f"{', '.join(kinds)} in the eligible layers can go (one of each kind stays)"
                    )
                break
            best: tuple[float, Block] | None = None
            for block in candidates:
                with without_block(model, block):
                    value = loss.from_layer(block.layer)
                if best is None or value < best[0]:
                    best = (value, block)
            assert best is not None
            value, block = best
            params = block_params(model, block, part)
            remove_block(model, block)
            loss.refresh(block.layer)
            step = SearchStep(block, value, params, len(candidates))
            result.steps.append(step)
            if progress is not None:
                progress(step)
    finally:
        model.train(was_training)
    result.seconds = time.perf_counter() - started
    return result


__all__ = ["LayerLoss", "SearchResult", "SearchStep", "search_blocks"]
