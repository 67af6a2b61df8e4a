"""Reconstruction: after a layer's units are removed, refit what remains to match the dense output.

Pure tensor functions on streamed statistics (no tokens are ever stored). Notation throughout:
a consumer ``y = W x`` (``W``: ``d_out x d_in``), calibration inputs as columns of ``X``
(``d_in x T``), Gram ``G = X Xᵀ = Σ_t x_t x_tᵀ``; every solve is float64 and results come back in the
weight's dtype and on its device.

* :mod:`.gram`: the statistics. :class:`GramStatistics` (``G``, ``Σ x`` and ``T`` of one module's
  input; its Gram part is :class:`~slimkit.primitives.projection.pca.GramAccumulator`),
  :class:`MeanAccumulator` (``Σ x``, ``T``), :class:`CrossGramAccumulator` (``Σ a bᵀ`` of paired
  batches: dense vs compressed inputs, or dense outputs vs inputs), :func:`gram_hooks` (attach
  :class:`GramStatistics` to module inputs), :func:`with_bias_column` (Gram of ``[x; 1]``).
* :mod:`.solve`: the damped ridge solve every refit ends in, ``B (G + λI)⁻¹`` with
  ``λ = damping · mean(diag(G))``, Cholesky with x10 escalation then ``lstsq`` (:func:`damped_solve`,
  :func:`damped_inverse`, :class:`SolveInfo`).
* :mod:`.least_squares`: refit the consumer on its kept input columns,
  ``W' = W G[:, K] (G[K, K] + λI)⁻¹`` (:func:`refit_least_squares`), or against the dense output from
  other inputs, ``W C[:, K] (G_c[K, K] + λI)⁻¹`` (:func:`refit_to_dense`); weights and bias together, on
  centred statistics (:func:`refit_affine`).
* :mod:`.obs`: structured optimal brain surgeon (ZipLM / SlimGPT): per-group costs
  ``tr(W_S (H⁻¹_SS)⁻¹ W_Sᵀ)`` (:func:`obs_costs`), one update + inverse-Hessian downdate
  (:func:`obs_remove`), the greedy order (:func:`obs_order`, a scorer), and both together
  (:func:`obs_prune`: selection and refit in one).
* :mod:`.bias`: FLAP's mean compensation ``Δb = W[:, S] x̄_S`` (:func:`bias_compensation`); giving a
  consumer a bias through its architecture's global flag (:func:`consumer_bias`, :func:`bias_refusal`).
* :mod:`.lowrank_refit`: for ``W ≈ L R`` with ``R`` fixed, ``L' = W G Rᵀ (R G Rᵀ + λI)⁻¹``
  (:func:`refit_left`).
* :mod:`.error`: ``tr((W − Ŵ) G (W − Ŵ)ᵀ)`` (:func:`output_error`) and column index helpers
  (:func:`kept_columns`, :func:`embed_columns`).

Which statistics: a consumer's *input* Gram, i.e. ``down_proj``'s input for MLP channels (and
``fc2``'s for OPT/BERT), ``o_proj``'s input for attention heads (``head_dim`` columns per head).
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
from slimkit.primitives.reconstruct.obs import (
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
