"""Reconstruction: after a layer's units are removed, refit what remains to match the dense output.

Pure tensor functions on streamed statistics (Gram matrices, no stored tokens), solved in float64 and returned in the
weight's dtype and device.

Method note: docs/methods/reconstruct-least-squares.md.
"""

from slimkit.primitives.reconstruct.bias import BIAS_FLAGS, bias_compensation, bias_refusal, consumer_bias
from slimkit.primitives.reconstruct.error import as_indices, embed_columns, kept_columns, output_energy, output_error
from slimkit.primitives.reconstruct.gram import (
    CrossGramAccumulator,
    GramStatistics,
    MeanAccumulator,
    gram_hooks,
    with_bias_column,
)
from slimkit.primitives.reconstruct.least_squares import (
    AffineRefit,
    Refit,
    centred,
    refit_affine,
    refit_least_squares,
    refit_to_dense,
)
from slimkit.primitives.reconstruct.lowrank_refit import refit_left
from slimkit.primitives.reconstruct.obs_update import (
    ObsOrder,
    ObsPrune,
    ObsStep,
    contiguous_groups,
    inverse_hessian,
    obs_costs,
    obs_order,
    obs_prune,
    obs_remove,
)
from slimkit.primitives.reconstruct.solve import (
    DEFAULT_DAMPING,
    DEFAULT_OBS_DAMPING,
    SolveInfo,
    damped_inverse,
    damped_solve,
)

__all__ = [
    "BIAS_FLAGS",
    "DEFAULT_DAMPING",
    "DEFAULT_OBS_DAMPING",
    "AffineRefit",
    "CrossGramAccumulator",
    "GramStatistics",
    "MeanAccumulator",
    "ObsOrder",
    "ObsPrune",
    "ObsStep",
    "Refit",
    "SolveInfo",
    "as_indices",
    "bias_compensation",
    "bias_refusal",
    "centred",
    "consumer_bias",
    "contiguous_groups",
    "damped_inverse",
    "damped_solve",
    "embed_columns",
    "gram_hooks",
    "inverse_hessian",
    "kept_columns",
    "obs_costs",
    "obs_order",
    "obs_prune",
    "obs_remove",
    "output_energy",
    "output_error",
    "refit_affine",
    "refit_least_squares",
    "refit_left",
    "refit_to_dense",
    "with_bias_column",
]
