"""One-shot hidden-dimension reduction by group PCA (SP3 Algorithm 1 + F.1), layer by layer.

:func:`project_hidden_dimension` folds the norms, computes one PCA basis per group of consecutive layers on the
calibration stream and fuses the projections into the weights (:mod:`.fuse`).

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.calibration import LayerInputs, capture_layer_inputs, run_layer
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection.adapters import basis_change_params, basis_changes
from slimkit.primitives.projection.fuse import (
    Residual,
    fuse_boundary,
    fuse_ends,
    fuse_layer,
    fuse_projection,
    layer_groups,
    retarget_boundary,
)
from slimkit.primitives.projection.norms import (
    TiedHead,
    check_pre_norm,
    fold_rms_norms,
    is_rms_norm,
    layernorm_to_rmsnorm,
)
from slimkit.primitives.projection.pca import (
    GramAccumulator,
    PrincipalComponents,
    identity_components,
    principal_components,
)
from slimkit.primitives.projection.widths import (
    projected_param_count,
    uniform_widths,
    variance_widths,
    widths_for_params,
)


@dataclass(frozen=True)
class ProjectionSettings:
    group_size: int | None = 4
    """Decoder layers per group; None: one basis for all layers (no residual matrices)."""
    ratio: float | None = 0.0
    """Fraction of hidden dimensions removed (layer-weighted mean); None: solve from ``keep_params``."""
    keep_params: int | None = None
    """Parameter budget of the projected model (residual matrices included), used when ``ratio`` is None."""
    allocation: Literal["uniform", "variance"] = "uniform"
    basis: Literal["pca", "identity"] = "pca"
    statistics: Literal["dense", "projected"] = "dense"
    normalise: bool = False
    """Accumulate ``x / rms(x)`` instead of the raw stream (see :mod:`.pca`)."""
    tied_head: TiedHead = "joint"
    """A tied embedding: ``shared`` (group 1's basis), ``joint`` (its own, from both uses, when something is
    sliced), ``own`` (its own also at full width, for stages that slice the stream later: mask training) or
    ``untie``."""
    residual: Residual = "eq34"
    """Group boundaries: ``eq34`` (Eq. 34: the boundary block writes the next basis, ``W_R`` on its residual
    branch) or ``input`` (``W_R`` on the whole stream at the next group's input; see :mod:`.fuse`)."""

    def check(self) -> None:
        if self.group_size is not None and self.group_size < 1:
            raise SlimkitError(f"group_size must be >= 1 or 'all', got {self.group_size}")
        if self.ratio is None and self.keep_params is None:
            raise SlimkitError("give ratio (hidden dimensions removed) or keep_params (a parameter budget)")
        if self.ratio is not None and not 0.0 <= self.ratio < 1.0:
            raise SlimkitError(f"ratio (fraction of hidden dimensions removed) must be in [0, 1), got {self.ratio}")
        if self.statistics == "projected" and self.allocation == "variance":
            raise SlimkitError("allocation: variance compares all groups' spectra; it needs statistics: dense")
        if self.residual not in ("eq34", "input"):
            raise SlimkitError(f"residual must be 'eq34' (Eq. 34) or 'input' (the whole stream), got {self.residual!r}")


def _accumulate_layer(
    layer, inputs: LayerInputs, accumulator: GramAccumulator, first: bool, output: bool
) -> list[torch.Tensor]:
    """Run one layer on ``inputs``; returns its outputs. ``accumulator`` takes the mid-layer stream (the
    MLP norm's input), the layer's input when ``first`` (the group's input) and its output when ``output``."""
    norms = (layer.attn_norm, layer.mlp_norm) if first else (layer.mlp_norm,)
    hooks = [norm.module.register_forward_pre_hook(lambda _m, args: accumulator.update(args[0])) for norm in norms]
    try:
        outputs = run_layer(layer.module, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    if output:
        for hidden in outputs:
            accumulator.update(hidden)
    return outputs


def _group_statistics(
    view: ModelView, layers: range, inputs: LayerInputs, accumulator: GramAccumulator, keep_last: bool
) -> list[torch.Tensor]:
    """Run a group's layers on ``inputs`` accumulating the streams its basis represents (module docstring);
    ``keep_last``: whether the group's output is one of them. Returns the group's outputs."""
    for index in layers:
        last = index == layers[-1]
        inputs.hidden = _accumulate_layer(
            view.layer(index), inputs, accumulator, index == layers[0], keep_last or not last
        )
    return inputs.hidden


def _keeps_output(settings: ProjectionSettings, g: int, groups: Sequence[range]) -> bool:
    return settings.residual == "input" or g == len(groups) - 1


class _TiedStatistics:
    """The two uses of a tied embedding matrix: the first layer's input and the head's input.

    The head reads ``γ_F ⊙ x / rms(x)`` of the final stream (γ_F still in the final norm when the tie
    is kept). Each Gram is scaled to unit trace before they are summed, so both uses weigh the same.
    """

    def __init__(self, model: nn.Module, normalise: bool, basis: str) -> None:
        view = ModelView(model)
        final = view.final_norm.module
        self.gamma = final.weight.detach().double()
        self.eps = float(getattr(final, "variance_epsilon", getattr(final, "eps", None) or 1e-6))
        self.inputs = GramAccumulator(view.hidden_size, normalise=normalise)
        self.head = GramAccumulator(view.hidden_size)
        self.rule = principal_components if basis == "pca" else identity_components

    def update_head(self, x: torch.Tensor) -> None:
        x = x.double()
        self.head.update(x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.gamma)

    def components(self) -> PrincipalComponents:
        gram = self.inputs.gram / self.inputs.gram.trace() + self.head.gram / self.head.gram.trace()
        return self.rule(gram)


def _tied_statistics(model: nn.Module, settings: ProjectionSettings) -> _TiedStatistics | None:
    if settings.tied_head not in ("joint", "own") or not ModelView(model).tied:
        return None
    return _TiedStatistics(model, settings.normalise, settings.basis)


def _dense_statistics(
    model: nn.Module, groups: Sequence[range], batches: Sequence[torch.Tensor], settings: ProjectionSettings
) -> tuple[list[PrincipalComponents], _TiedStatistics | None]:
    view = ModelView(model)
    accumulators = [GramAccumulator(view.hidden_size, normalise=settings.normalise) for _ in groups]
    tied = _tied_statistics(model, settings)
    inputs = capture_layer_inputs(model, view.layer(0).module, batches)
    if tied is not None:
        for hidden in inputs.hidden:
            tied.inputs.update(hidden)
    for g, layers in enumerate(groups):
        inputs.hidden = _group_statistics(view, layers, inputs, accumulators[g], _keeps_output(settings, g, groups))
    if tied is not None:
        for hidden in inputs.hidden:
            tied.update_head(hidden)
    return [acc.components(settings.basis) for acc in accumulators], tied


def _projected_pass(
    model: nn.Module,
    groups: Sequence[range],
    widths: Sequence[int],
    batches: Sequence[torch.Tensor],
    settings: ProjectionSettings,
) -> tuple[list[PrincipalComponents], list[torch.Tensor], _TiedStatistics | None]:
    """Statistics and fusing of the layers group by group, each group calibrated on the projected
    groups' outputs; the embeddings and the head are left to the caller (:func:`~.fuse.fuse_ends`).

    With ``residual="eq34"`` a group's boundary layer first writes the original coordinates (its
    output is the next group's calibration stream, before the next basis exists); once that basis is
    known, :func:`~.fuse.retarget_boundary` points it there."""
    view = ModelView(model)
    d = view.hidden_size
    tied = _tied_statistics(model, settings)
    captured = capture_layer_inputs(model, view.layer(0).module, batches)
    kwargs = captured.kwargs
    if tied is not None:
        for hidden in captured.hidden:
            tied.inputs.update(hidden)
    dense_in = captured.hidden  # the group's input in the original coordinates
    compressed: list[torch.Tensor] = []  # the same stream in the previous group's basis
    components: list[PrincipalComponents] = []
    bases: list[torch.Tensor] = []
    eq34 = settings.residual == "eq34"
    identity = torch.eye(d, dtype=torch.float64)
    for g, layers in enumerate(groups):
        accumulator = GramAccumulator(d, normalise=settings.normalise)
        inputs = LayerInputs(list(dense_in), kwargs)
        final = _group_statistics(view, layers, inputs, accumulator, _keeps_output(settings, g, groups))
        if g == len(groups) - 1 and tied is not None:
            for hidden in final:
                tied.update_head(hidden)
        components.append(accumulator.components(settings.basis))
        basis = components[-1].basis(widths[g])
        bases.append(basis)
        identity = identity.to(basis.device)  # the statistics' device (CUDA for a model there)
        if g == 0 or eq34:  # the group's input, in the original coordinates, in its own basis
            compressed = [(h.double() @ basis).to(h.dtype) for h in dense_in]
        last = g == len(groups) - 1
        for index in layers:
            fuse_layer(model, index, basis, identity if eq34 and not last and index == layers[-1] else None)
        if g > 0 and eq34:
            retarget_boundary(model, layers[0], bases[g - 1], basis)
        elif g > 0:
            fuse_boundary(model, layers[0], bases[g - 1], basis, "input")
        if last:
            break
        if eq34:
            fuse_boundary(model, layers[-1] + 1, basis, identity, "eq34")
        outputs = LayerInputs(compressed, kwargs)
        for index in layers:
            outputs.hidden = run_layer(ModelView(model).layer(index).module, outputs)
        if eq34:
            dense_in = outputs.hidden
        else:
            compressed = outputs.hidden
            dense_in = [(h.double() @ basis.T).to(h.dtype) for h in compressed]
    return components, bases, tied


def _embedding_basis(
    tied: _TiedStatistics | None, first: torch.Tensor, full_width: bool = False
) -> torch.Tensor | None:
    """A tied embedding's own basis (None: it shares the first group's); only when something is sliced, or
    with ``full_width`` (``tied_head="own"``) also when nothing is."""
    if tied is None or (first.shape[1] == first.shape[0] and not full_width):
        return None
    return tied.components().basis(first.shape[1])


def _is_layernorm_model(view: ModelView) -> bool:
    return not is_rms_norm(view.layer(0).attn_norm.module)


def project_hidden_dimension(model: nn.Module, batches: Sequence[torch.Tensor], settings: ProjectionSettings) -> dict:
    """Reduce the hidden dimension of ``model`` in place by group PCA; returns a report (see module docstring).

    The report holds the groups (layer ranges), their hidden widths and explained fractions, the
    residual-matrix parameters, and the parameter counts with and without them.
    """
    settings.check()
    view = ModelView(model)
    check_pre_norm(view)
    if basis_changes(model):
        raise SlimkitError("the model already carries basis changes; project a model only once")
    if not batches:
        raise SlimkitError("hidden-dimension projection needs calibration batches")
    report: dict = {"converted_layernorm": False}
    if _is_layernorm_model(view):
        report.update(layernorm_to_rmsnorm(model))
    folded = fold_rms_norms(model, settings.tied_head)
    report["untied_head"] = bool(report.get("untied_head")) or folded["untied_head"]
    view = ModelView(model)
    d = view.hidden_size
    groups = layer_groups(view.num_layers, settings.group_size)
    sizes = [len(layers) for layers in groups]

    if settings.statistics == "dense":
        components, tied = _dense_statistics(model, groups, batches, settings)
        if settings.ratio is None:
            components_rule = components if settings.allocation == "variance" else None
            widths = widths_for_params(
                model, groups, settings.keep_params, components_rule, settings.tied_head, settings.residual
            )
        elif settings.allocation == "variance":
            widths = variance_widths(components, sizes, settings.ratio)
        else:
            widths = uniform_widths(d, len(groups), settings.ratio)
        expected = projected_param_count(model, groups, widths, settings.tied_head, settings.residual)
        bases = [c.basis(k) for c, k in zip(components, widths, strict=True)]
        own = _embedding_basis(tied, bases[0], settings.tied_head == "own")
        fuse_projection(model, groups, bases, own, settings.residual)
    else:
        if settings.ratio is None:
            widths = widths_for_params(
                model, groups, settings.keep_params, tied_head=settings.tied_head, residual_form=settings.residual
            )
        else:
            widths = uniform_widths(d, len(groups), settings.ratio)
        expected = projected_param_count(model, groups, widths, settings.tied_head, settings.residual)
        components, bases, tied = _projected_pass(model, groups, widths, batches, settings)
        fuse_ends(model, bases[0], bases[-1], _embedding_basis(tied, bases[0], settings.tied_head == "own"))

    residual = basis_change_params(model)
    total = ModelView(model).num_params()
    mean_width = sum(n * k for n, k in zip(sizes, widths, strict=True)) / sum(sizes)
    report.update(
        {
            "hidden_size": d,
            "group_size": settings.group_size if settings.group_size is not None else "all",
            "groups": [
                {
                    "layers": [layers[0], layers[-1]],
                    "hidden_size": k,
                    "explained": float(c.explained()[k - 1]),
                }
                for layers, k, c in zip(groups, widths, components, strict=True)
            ],
            "layer_hidden_sizes": [widths[g] for g, layers in enumerate(groups) for _ in layers],
            "hidden_reduction": 1.0 - mean_width / d,
            "allocation": settings.allocation,
            "basis": settings.basis,
            "statistics": settings.statistics,
            "residual": settings.residual,
            "normalised_features": settings.normalise,
            "tokens": sum(int(b.numel()) for b in batches),
            "residual_matrices": len(basis_changes(model)),
            "residual_params": residual,
            "params": total,
            "params_without_residual": total - residual,
            "params_expected": expected["total"],
        }
    )
    return report


__all__ = ["ProjectionSettings", "project_hidden_dimension"]
