"""The low-rank allocation pre-pass: every chosen matrix's rank, decided before a layer-wise block runs.

A ``lowrank`` stage with ``allocation: {global: {max_fraction}}`` removes the same total as its per-layer rules
would (``ratio``, or LoRAP's layer ratio, of every chosen matrix's parameters), shared among the matrices of every
layer by :func:`~slimkit.primitives.lowrank.rank_allocation.allocate_ranks`: each matrix's squared singular values
under the stage's own method (:func:`~slimkit.primitives.lowrank.svd.singular_energies`: ``W``, ``W D`` with the
layer's input norms, or ``W S`` with its input Gram), on the dense inputs of the model as it is when the block starts
(:func:`~slimkit.engine.allocation_prepass.dense_layer_statistics`, one layer alive at a time; ``svd`` needs no
calibration). The ranks and the parameters they save go into the stage's state
(:class:`~slimkit.stages.allocation_results.RankAllocation`); the block's plan is then exact, so a solving stage
after it in the same block (``prune_layer`` with its own allocation) lands the rest of the target."""

from __future__ import annotations

import time

import torch

from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.primitives.arch import LayerView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.lowrank import max_useful_rank, singular_energies
from slimkit.primitives.lowrank.rank_allocation import (
    MatrixSpectrum,
    RankBudgetOutOfReach,
    allocate_ranks,
    min_rank_for,
    most_saved,
    saved_params,
)
from slimkit.stages.allocation_results import RankAllocation
from slimkit.stages.lowrank import LowRankArgs, LowRankState, global_wanted, lowrank_fraction, whiten_failure


def _energies(ctx: Context, args: LowRankArgs, layer: LayerView, role: LinearRole, stats: LayerStats) -> torch.Tensor:
    linear = layer.linear(role)
    if args.method == "awsvd":
        return singular_energies(linear.weight, input_norms=stats["input_norms"][ctx.view.path_of(linear)])
    if args.method == "whiten":
        try:
            return singular_energies(linear.weight, gram=stats["dense_consumers"][role].gram)
        except ValueError as error:  # a Gram with NaN/inf entries
            raise whiten_failure(layer, role, error) from None
    return singular_energies(linear.weight)


def _kept_share(keys: list[tuple[int, str]], spectra: list[MatrixSpectrum], ranks: list[int | None]) -> dict:
    """Per role, the mean fraction of its parameters the ranks keep (a dense matrix keeps 1)."""
    shares: dict[str, list[float]] = {}
    for (_layer, role), spectrum, rank in zip(keys, spectra, ranks, strict=True):
        shares.setdefault(role, []).append(1.0 - spectrum.saved(rank) / (spectrum.d_in * spectrum.d_out))
    return {role: round(sum(values) / len(values), 4) for role, values in shares.items()}


def _bounds(args: LowRankArgs, shape: tuple[int, int], max_fraction: float) -> tuple[int, int]:
    """``(max_rank, min_rank)`` of a ``(d_out, d_in)`` matrix under the stage's speed cap and ``max_fraction``."""
    d_out, d_in = shape
    return max_useful_rank(d_in, d_out, args.mac_fraction), min_rank_for(d_out, d_in, max_fraction)


def check_rank_reachable(ctx: Context, args: LowRankArgs) -> None:
    """Refuse, on shapes alone (before calibration), a share the matrices cannot save even at their lowest ranks."""
    settings = args.global_settings()
    assert settings is not None, "check_rank_reachable needs allocation: global"
    wanted = global_wanted(ctx, args, lowrank_fraction(ctx, args))
    most = 0
    for layer in ctx.view.layers:
        for role in (r for r in args.roles if r in layer.roles):
            d_out, d_in = layer.linear(role).weight.shape
            most += most_saved(d_out, d_in, *_bounds(args, (d_out, d_in), settings.max_fraction))
    if wanted > most:
        raise SlimkitError(_out_of_reach(args, settings.max_fraction, RankBudgetOutOfReach(wanted, most)))


def _out_of_reach(args: LowRankArgs, max_fraction: float, error: Exception) -> str:
    return (
        f"lowrank (allocation global): {error} (mac_fraction {args.mac_fraction:g}, max_fraction {max_fraction:g}); "
        "lower the target or raise max_fraction"
    )


class RankSpectra:
    """The pre-pass of a ``lowrank`` stage with ``allocation: global``
    (:class:`~slimkit.engine.allocation_prepass.PrePass`): every chosen matrix's spectrum as the shared dense pass
    reaches its layer (``svd``: the weights alone), then the ranks that save the stage's share; the block's plan is
    updated to exactly what they save."""

    def __init__(self, state: LowRankState) -> None:
        ctx, args = state.ctx, state.args
        settings = args.global_settings()
        assert settings is not None, "RankSpectra needs allocation: global"
        self.state, self.ctx, self.args, self.max_fraction = state, ctx, args, settings.max_fraction
        self.scoring_batches: int | None = None if args.method == "svd" else len(ctx.calibration_batches())
        self.roles = frozenset(args.layer_grams())
        self.last = ctx.view.num_layers - 1
        self.keys: list[tuple[int, str]] = []
        self.spectra: list[MatrixSpectrum] = []

    def visit(self, layer: LayerView, stats: LayerStats) -> None:
        for role in (r for r in self.args.roles if r in layer.roles):  # a hybrid's layers hold some
            d_out, d_in = layer.linear(role).weight.shape
            high, low = _bounds(self.args, (d_out, d_in), self.max_fraction)
            energies = _energies(self.ctx, self.args, layer, role, stats)
            self.spectra.append(MatrixSpectrum(d_out, d_in, energies, high, low))
            self.keys.append((layer.index, role))

    def decide(self, ctx: Context, pass_seconds: float) -> None:
        began = time.perf_counter()
        args = self.args
        wanted = global_wanted(ctx, args, self.state.fraction)  # what the block's plan counted until now
        tolerance = round(ctx.recipe.target.tolerance * ctx.params_before[ctx.recipe.target.part])
        try:
            ranks = allocate_ranks(self.spectra, wanted, tolerance)
        except (RankBudgetOutOfReach, ValueError) as error:
            raise SlimkitError(_out_of_reach(args, self.max_fraction, error)) from None
        by_layer: dict[int, dict[str, int | None]] = {}
        for (index, role), rank in zip(self.keys, ranks, strict=True):
            by_layer.setdefault(index, {})[role] = rank
        saved = saved_params(self.spectra, ranks)
        passed = pass_seconds
        report = {
            "method": "global",
            "wanted": wanted,
            "removed": saved,
            "kept_share": _kept_share(self.keys, self.spectra, ranks),
            "score_seconds": passed,  # the block's shared dense pass
            "seconds": round(passed + time.perf_counter() - began, 3),
        }
        self.state.allocation = RankAllocation(by_layer, saved, report)
        ctx.block.planned += saved - wanted  # now exactly what the ranks save


__all__ = ["RankSpectra", "check_rank_reachable"]
