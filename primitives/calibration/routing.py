"""Calibration statistics that follow the routing of a mixture-of-experts model.

One forward pass over the calibration batches with a hook on each layer's router (every layer, or a ``layers``
subset: the pass then stops after the deepest of them). The hook sees the tokens the router reads and the experts it
picks for each (top-k weights included) and folds them into per-expert running sums: tokens received (``counts``),
top-k weight received (``mass``), the router's softmax summed over every token (``probability``); on request the
per-channel sums of squares of an expert's inputs (``input_sq``) and of its intermediate activations
``a = act(gate x) * up x`` on only its tokens (``channel_sq``), and the Gram of those activations with each token
weighted by its routing weight squared (``gram``: ``sum w^2 a a^T``, what a refit of the down projection needs).
No token is kept, except a bounded, evenly spread sample of each layer's router inputs (``inputs``, ``keep_inputs``).

Sums are float32 (float64 for the counts) on ``stats_device`` (default: each router's device): ``experts x (hidden
+ width)`` numbers a layer, plus ``experts x width^2`` with Grams. Method note: ``docs/methods/moe-experts.md``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimkit.primitives.arch.moe import MoEBlock, moe_blocks
from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.experts.routed import ExpertWeights, expert_intermediate
from slimkit.primitives.experts.routers import probabilities, route


@dataclass
class ExpertRouting:
    """One MoE layer's routing statistics over the calibration tokens."""

    layer: int
    tokens: int
    counts: torch.Tensor
    """``(experts,)``: tokens routed to each expert (each token counts once for each of its top-k experts)."""
    mass: torch.Tensor
    """``(experts,)``: the summed top-k routing weight each expert received."""
    probability: torch.Tensor
    """``(experts,)``: the router's softmax probability (a sigmoid router's score) of each expert summed over every
    token."""
    input_sq: torch.Tensor | None = None
    """``(experts, hidden)``: sum of squares of each input channel over the tokens routed to each expert."""
    channel_sq: torch.Tensor | None = None
    """``(experts, width)``: sum of squares of each expert's intermediate channels over the tokens routed to it."""
    inputs: torch.Tensor | None = None
    """``(n, hidden)``: a sample of the router's input tokens (None unless asked for)."""
    gram: torch.Tensor | None = None
    """``(experts, width, width)``: ``sum w^2 a a^T`` over the tokens routed to each expert, ``a`` its intermediate
    activations and ``w`` the token's routing weight for it (None unless asked for)."""

    @property
    def frequency(self) -> torch.Tensor:
        """Share of tokens that pick each expert among their top-k (sums to top-k)."""
        return self.counts / max(self.tokens, 1)

    @property
    def mean_weight(self) -> torch.Tensor:
        """Each expert's routing weight averaged over every token (zero where it is not in the top-k)."""
        return self.mass / max(self.tokens, 1)

    def kept_mass(self, kept: Sequence[int]) -> float:
        """Share of the layer's total routing mass (top-k weights) held by the ``kept`` experts."""
        total = float(self.mass.sum())
        return float(self.mass[list(kept)].sum()) / total if total > 0 else 0.0


class _StopForward(Exception):
    """Raised after the deepest hooked layer's router when the rest of the forward is not needed."""


class _RouterHook:
    def __init__(
        self,
        block: MoEBlock,
        channels: bool,
        grams: bool,
        per_batch: int,
        stats_device: torch.device | None,
        stop: bool = False,
    ) -> None:
        self.block = block
        self.channels = channels
        self.grams = grams
        self.stop = stop
        self.per_batch = per_batch
        self.device = stats_device
        self.stats: ExpertRouting | None = None
        self.samples: list[torch.Tensor] = []

    def _init(self, hidden: int, device: torch.device) -> ExpertRouting:
        experts, width = self.block.num_experts, self.block.width
        where = self.device or device

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=where)

        return ExpertRouting(
            layer=self.block.index,
            tokens=0,
            counts=zeros(experts, dtype=torch.float64),
            mass=zeros(experts),
            probability=zeros(experts),
            input_sq=zeros(experts, hidden) if self.channels else None,
            channel_sq=zeros(experts, width) if self.channels else None,
            gram=zeros(experts, width, width) if self.grams else None,
        )

    @torch.no_grad()
    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        # The routing is recomputed from the router's input by the family's rule (routers return different tuples).
        x = args[0].reshape(-1, args[0].shape[-1])
        weights = ExpertWeights.of(self.block)
        chosen = route(weights.rule, x)
        index, scores = chosen.index, chosen.weight
        stats = self.stats = self.stats or self._init(x.shape[1], x.device)
        where = stats.counts.device
        stats.tokens += x.shape[0]
        flat = index.reshape(-1).to(where)
        stats.counts += torch.bincount(flat, minlength=stats.counts.numel()).to(torch.float64)
        stats.mass.index_add_(0, flat, scores.reshape(-1).float().to(where))
        stats.probability += probabilities(weights.rule, x).sum(dim=0).to(where)
        if self.channels or self.grams:
            for expert in index.unique().tolist():
                token, slot = torch.where(index == expert)
                routed = x[token]
                if chosen.input_scale is not None:  # Llama 4: the expert reads its input scaled
                    routed = routed * chosen.input_scale[token, slot, None].to(routed.dtype)
                act = expert_intermediate(weights, expert, routed).float()
                if stats.input_sq is not None and stats.channel_sq is not None:
                    stats.input_sq[expert] += routed.float().pow(2).sum(dim=0).to(where)
                    stats.channel_sq[expert] += act.pow(2).sum(dim=0).to(where)
                if stats.gram is not None:
                    weighted = act * scores[token, slot].float()[:, None]
                    stats.gram[expert] += (weighted.T @ weighted).to(where)
        if self.per_batch:
            step = max(1, x.shape[0] // self.per_batch)
            self.samples.append(x[::step][: self.per_batch].detach().to(where))
        if self.stop:
            raise _StopForward


@torch.no_grad()
def collect_routing(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    channels: bool = False,
    grams: bool | Collection[int] = False,
    keep_inputs: int = 0,
    layers: Collection[int] | None = None,
    stats_device: torch.device | str | None = None,
) -> dict[int, ExpertRouting]:
    """Routing statistics of the MoE layers of ``model`` over ``batches`` (token ids ``[batch, seq]``), by layer
    index. ``channels``: also the per-expert channel sums of squares; ``grams``: also the routing-weighted Grams of
    the experts' intermediate activations (True: in every hooked layer; a collection: in those layers only);
    ``keep_inputs``: also a sample of at most this many router input tokens per layer; ``layers``: hook only these
    layers (by index; None: all) and stop each forward after the deepest of them."""
    device = torch.device(stats_device) if stats_device is not None else None
    per_batch = math.ceil(keep_inputs / max(len(batches), 1)) if keep_inputs else 0
    blocks = [b for b in moe_blocks(model) if layers is None or b.index in layers]
    deepest = max((b.index for b in blocks), default=-1) if layers is not None else None
    hooks = {
        block.index: _RouterHook(
            block,
            channels,
            grams is True or (not isinstance(grams, bool) and block.index in grams),
            per_batch,
            device,
            stop=block.index == deepest,
        )
        for block in blocks
    }
    handles = [hook.block.router.register_forward_hook(hook) for hook in hooks.values()]
    try:
        for batch in batches:
            try:
                model(to_input_device(model, batch), use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for index, hook in hooks.items():
        if hook.stats is None:
            continue
        if hook.samples:
            hook.stats.inputs = torch.cat(hook.samples)[:keep_inputs]
        result[index] = hook.stats
    return result


__all__ = ["ExpertRouting", "collect_routing"]
