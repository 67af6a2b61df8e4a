"""Hidden-dimension projection (SP3): streamed PCA, norm folding and conversion, fusing, residual matrices.

Method note: docs/methods/sp3-projection.md.
"""

from slimkit.primitives.projection.adapters import (
    BasisChange,
    attach_basis_change,
    basis_change_params,
    basis_changes,
)
from slimkit.primitives.projection.fuse import (
    fuse_boundary,
    fuse_embeddings,
    fuse_ends,
    fuse_head,
    fuse_layer,
    fuse_projection,
    layer_groups,
)
from slimkit.primitives.projection.hidden import ProjectionSettings, project_hidden_dimension
from slimkit.primitives.projection.manifest import projection_entries
from slimkit.primitives.projection.norms import (
    centring_matrix,
    fold_rms_norms,
    layernorm_projection,
    layernorm_to_rmsnorm,
    projected_layernorm,
    residual_matrix,
    untie_head,
)
from slimkit.primitives.projection.pca import (
    GramAccumulator,
    PrincipalComponents,
    identity_components,
    pca,
    principal_components,
)
from slimkit.primitives.projection.postnorm import (
    hidden_norms,
    norm_statistics,
    project_post_norm,
    slice_post_norm_hidden,
)
from slimkit.primitives.projection.slice import slice_stream, stream_groups
from slimkit.primitives.projection.widths import (
    projected_param_count,
    uniform_widths,
    variance_widths,
    widths_for_params,
)

__all__ = [
    "BasisChange",
    "GramAccumulator",
    "PrincipalComponents",
    "ProjectionSettings",
    "attach_basis_change",
    "basis_change_params",
    "basis_changes",
    "centring_matrix",
    "fold_rms_norms",
    "fuse_boundary",
    "fuse_embeddings",
    "fuse_ends",
    "fuse_head",
    "fuse_layer",
    "fuse_projection",
    "hidden_norms",
    "identity_components",
    "layer_groups",
    "layernorm_projection",
    "layernorm_to_rmsnorm",
    "norm_statistics",
    "pca",
    "principal_components",
    "project_hidden_dimension",
    "project_post_norm",
    "projected_layernorm",
    "projected_param_count",
    "projection_entries",
    "residual_matrix",
    "slice_post_norm_hidden",
    "slice_stream",
    "stream_groups",
    "uniform_widths",
    "untie_head",
    "variance_widths",
    "widths_for_params",
]
