"""``pca_project`` (model scope): one-shot hidden-dimension reduction by group PCA (SP3, Hu et al. 2024).

(``pca_project_post``, at the end of this file, is the post-norm encoder (BERT) counterpart: one basis
per hidden LayerNorm, full width, for ``mask_train_encoder``.)

LayerNorm models are converted to RMSNorm and RMSNorm γs folded; the residual stream's Gram matrix is accumulated per
group of ``group_size`` decoder layers, the top principal components of each group kept, and the projections fused
into the weights with a residual matrix where the basis changes. ``group_size: all`` uses one basis for every layer;
``ratio`` is the fraction of hidden dimensions removed (None: solved from the recipe target, residual matrices
counted); with ``ratio: 0`` the model keeps its shape and is only re-represented in the PCA basis.

Method note: docs/methods/sp3-projection.md.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from slimkit.engine.capabilities import ChecksModel, PlansMemory
from slimkit.engine.context import Context
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import LAYERWISE_ADVICE, MemoryInputs
from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.view import LinearRole
from slimkit.primitives.device.memory_model import FLOAT32, StageMemory, layer_input_bytes
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.projection import ProjectionSettings, project_hidden_dimension
from slimkit.primitives.projection.norms import BLOCK_ROWS
from slimkit.recipes.schema import Recipe
from slimkit.recipes.stage_args import (
    ALL_ROLES,
    BudgetMode,
    ChangesProjections,
    ChecksRecipe,
    ReadsData,
    SharesTarget,
    StageArgs,
)


def projection_memory(stage: str, inputs: MemoryInputs) -> StageMemory:
    """Every calibration sample's inputs of one layer, the covariance, its eigenvectors and the rotation, and the
    largest weight rewritten in the new basis (the embedding or head: the new matrix beside the old one, and one
    block of rows in float64 three times: the block, its scaled copy and its product)."""
    shape = inputs.shape
    memory = StageMemory(stage, advice=LAYERWISE_ADVICE)
    memory.parts["layer inputs"] = layer_input_bytes(shape, inputs.samples, inputs.seq_len, inputs.dtype_bytes)
    memory.parts["matrices"] = 3 * shape.hidden * shape.hidden * FLOAT32
    widest = max(shape.vocab, shape.intermediate)
    memory.parts["rewritten weight"] = widest * shape.hidden * inputs.dtype_bytes + 3 * BLOCK_ROWS * shape.hidden * 8
    return memory


class PCAProjectArgs(StageArgs, SharesTarget, ChangesProjections, ReadsData, ChecksRecipe, PlansMemory, ChecksModel):
    group_size: int | Literal["all"] = 4
    """Decoder layers sharing one basis (4 = the paper's gs = 8 sub-layer blocks), or ``all``."""
    ratio: float | None = Field(None, ge=0.0, lt=1.0)
    """Fraction of hidden dimensions removed; None solves it from the recipe target (of: model)."""
    allocation: Literal["uniform", "variance"] = "uniform"
    """Widths across groups: ``uniform`` (the same) or ``variance`` (one explained-variance threshold)."""
    basis: Literal["pca", "identity"] = "pca"
    """``pca``: principal components; ``identity``: raw dimensions of largest second moment (Table 3)."""
    statistics: Literal["dense", "projected"] = "dense"
    """``dense``: each group's statistics from the dense model (Algorithm 1); ``projected``: from the
    already-projected groups' outputs."""
    features: Literal["input", "normalized"] = "input"
    """``input``: the raw stream the norms read (the paper); ``normalized``: each token divided by its RMS."""
    tokens: int | None = Field(None, ge=1)
    """Calibration tokens used for the statistics (whole calibration samples); None: all."""
    tied_head: Literal["shared", "joint", "own", "untie"] = "joint"
    """A tied embedding: ``joint`` (own basis from both its uses, when this stage slices), ``own`` (the same also at
    full width, for ``mask_train`` after it), ``shared`` (the first group's basis) or ``untie`` (copied into the
    head)."""
    residual: Literal["eq34", "input"] = "eq34"
    """Group boundaries: ``eq34`` (Appendix F.1 Eq. 34: the boundary block writes the next group's basis and
    ``U'ᵀ U`` multiplies its residual branch only) or ``input`` (``W_R`` maps the whole stream at the next
    group's input, so the boundary block's output is truncated twice; slimkit's earlier form)."""

    @field_validator("group_size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("group_size must be >= 1 or 'all'")
        return value

    def check_recipe(self, recipe: Recipe, where: str) -> None:
        """Without ``ratio`` the hidden widths are solved from a target of the whole model."""
        if self.ratio is None and recipe.target.of != "model":
            raise ValueError(
                f"{where}: pca_project without ratio solves the hidden widths from the whole model's target; set "
                f"target.of: model (got {recipe.target.of}), or give args.ratio (the fraction of hidden dimensions "
                "removed)"
            )

    def needs_calibration(self) -> bool:
        return True

    def budget(self) -> BudgetMode:
        return "explicit" if self.ratio is not None else "solve"

    def touches(self) -> frozenset[LinearRole]:
        return ALL_ROLES

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        return projection_memory(stage, inputs)

    def operations(self) -> frozenset[str]:
        return frozenset({"hidden_projection"})


def _keep_params(ctx: Context) -> int:
    target = ctx.recipe.target
    if target.of != "model":
        raise SlimkitError(
            f"pca_project without ratio solves the hidden widths from target.of: model (got {target.of}); "
            "or give args.ratio (the fraction of hidden dimensions removed)"
        )
    return target.kept_limit(ctx.params_before)


@register_stage(
    "pca_project",
    args=PCAProjectArgs,
    paper="SP3 §3.1, §3.3 (Eqs. 15-18), Appendix F.1 (group PCA, RMSNorm folding)",
    once="a model is projected once; its residual matrices would be projected again",
)
class PcaProject:
    """Reduce the hidden dimension by group PCA: fold norms, keep top-k components per group, fuse."""

    def run_model(self, ctx: Context, args: PCAProjectArgs) -> StageResult:
        return pca_project(ctx, args)


def pca_project(ctx: Context, args: PCAProjectArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    batches = ctx.calibration_batches()
    if args.tokens is not None and batches and ctx.calibration is not None:
        seq_len = batches[0].shape[1]
        samples = max(1, math.ceil(args.tokens / seq_len))
        batches = [b for b in ctx.calibration[:samples].split(batches[0].shape[0])]
    settings = ProjectionSettings(
        group_size=None if args.group_size == "all" else args.group_size,
        ratio=args.ratio,
        keep_params=_keep_params(ctx) if args.ratio is None else None,
        allocation=args.allocation,
        basis=args.basis,
        statistics=args.statistics,
        normalise=args.features == "normalized",
        tied_head=args.tied_head,
        residual=args.residual,
    )
    tied = ModelView(ctx.model).tied
    with ctx.tracker.task("pca_project", None):
        report = project_hidden_dimension(ctx.model, batches, settings)
    if tied and args.tied_head == "joint" and args.ratio == 0:
        # At full width nothing is sliced, so no own embedding basis is built (hidden.py): whatever slices the
        # stream later (mask_train) reaches the tied head through group 1's kept coordinates, as `shared` does.
        report["embedding_basis"] = "group 1's (full width: tied_head joint acts as shared)"
        ctx.notes.append(
            "pca_project: at full width the tied embedding shares group 1's basis (tied_head joint builds its own "
            "basis only when this stage slices); a later stage that slices the stream reaches the head through "
            "group 1's kept coordinates (sp3-llm vs sp3-oneshot, benchmarks/results/2026-11-25-claims-diagnostics.md)"
        )
    if report["residual_params"]:
        ctx.notes.append(
            f"pca_project: {report['residual_matrices']} residual matrices hold {report['residual_params']:,} "
            f"parameters; without them the model has {report['params_without_residual']:,}"
        )
    return StageResult(report)


class PCAProjectPostArgs(StageArgs, ChangesProjections, ReadsData, PlansMemory, ChecksModel):
    encoder_only: ClassVar[bool] = True

    basis: Literal["pca", "identity"] = "pca"
    """``identity``: raw dimensions by centred second moment (Table 3's "w/o PCA projection")."""
    tokens: int | None = Field(4096, ge=1)
    """Calibration tokens per Gram matrix (the paper's T = 4,096, section 4.1); None: all of them."""
    restore_output: bool = False
    """Map the last stream back to the original coordinates (only for heads reading the sequence output)."""

    def needs_calibration(self) -> bool:
        return True

    def touches(self) -> frozenset[LinearRole]:
        return ALL_ROLES

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        return projection_memory(stage, inputs)


@register_stage(
    "pca_project_post",
    args=PCAProjectPostArgs,
    paper="SP3 §3.1 (post-norm encoders: one basis per hidden LayerNorm)",
)
class PcaProjectPost:
    """Re-represent a post-norm encoder (BERT) in one PCA basis per hidden LayerNorm, at full width (SP3 §3.1).

    :func:`slimkit.primitives.projection.project_post_norm` with every component kept (an exact
    re-representation; the masks of ``mask_train_encoder`` then choose the widths). Calibration is
    the recipe's (``calibration.dataset: glue``: ``examples`` training examples of the task packed
    into ``samples x seq_len`` token windows; the paper: 512 examples, 4,096 tokens).
    """

    def run_model(self, ctx: Context, args: PCAProjectPostArgs) -> StageResult:
        return pca_project_post(ctx, args)


def pca_project_post(ctx: Context, args: PCAProjectPostArgs) -> StageResult:
    """The stage's work on ``ctx.model``; returns what it leaves."""
    from slimkit.primitives.projection.postnorm import project_post_norm

    with ctx.tracker.task("pca_project_post", None):
        report = project_post_norm(
            ctx.model,
            ctx.calibration_batches(),
            basis=args.basis,
            restore_output=args.restore_output,
            max_tokens=args.tokens,
        )
    report.pop("norms", None)
    if report["rank_deficient"]:
        ctx.notes.append(
            f"pca_project_post: {report['tokens']} calibration tokens < hidden size {report['hidden_size']}; "
            "the trailing components are arbitrary"
        )
    ctx.notes.append(
        f"pca_project_post: {report['residual_matrices']} residual matrices hold {report['residual_params']:,} "
        "parameters until the masks shrink them"
    )
    return StageResult(report)
