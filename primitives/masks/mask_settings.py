"""The settings of a mask-training run, declared once: :class:`MaskSettings` (what every run shares) and its two
kinds, :class:`StreamMaskSettings` (decoder LLMs, :mod:`.stream`) and :class:`EncoderMaskSettings` (post-norm
encoders on a GLUE task, :mod:`.encoder`). The recipe stages ``mask_train`` and ``mask_train_encoder`` take these
as their arguments (their argument models subclass them, adding only the data settings), so a name, its bounds,
its default and its description live here alone. What comes from the recipe rather than the stage (the target
ratio, the count it is a fraction of, the seed) is passed to the training functions beside the settings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from slimkit.primitives.masks.schedule import MaskSchedule
from slimkit.primitives.settings import Strict

EncoderHidden = Literal["per_norm", "shared", "none"]


class MaskSettings(Strict):
    """What every mask-training run shares: the schedule's fine-tuning and warm-up, the three learning rates,
    the gates' start and the distillation weight. Unknown names and non-finite numbers are refused."""

    finetune_steps: int = Field(0, ge=0)
    """Optimizer steps of plain fine-tuning (task loss only) before the masks join (SP3's first stage)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the target rises linearly from 0 (CoFi's Lagrangian warm-up)."""
    learning_rate: float = Field(1e-5, ge=0)
    """Weights' AdamW learning rate (0: train the masks only). The paper's LLM runs: 1e-5."""
    mask_learning_rate: float = Field(0.05, gt=0)
    """AdamW learning rate of the gates' log alpha."""
    lagrangian_learning_rate: float = Field(0.05, gt=0)
    """Learning rate of the Lagrange multipliers λ₁, λ₂ of Eq. 14 (they ascend)."""
    init_drop: float = Field(0.5, gt=0, lt=1)
    """Initial drop probability of every gate, in (0, 1) (CoFi: log alpha = log(1 − p) − log p)."""
    distill: float = Field(0.0, ge=0)
    """Weight of the distillation loss to the unmasked model's logits (decoders: KL of the next-token
    distributions; encoders: KL for classification, MSE for regression; 0: the task loss alone)."""
    rank_prior: float = Field(0.0, ge=0)
    """Spread of the hidden gates' initial log alpha over their principal-component rank (our addition): coordinate k
    of a d-wide gate starts at log alpha + rank_prior · (1/2 − k/(d−1)) (0: CoFi's uniform start). Needs gates on a
    PCA-ordered stream: a decoder's per-group gates, an encoder's per_norm gates."""


class StreamMaskSettings(MaskSettings):
    """SP3's LLM masks: one hidden gate per layer group on the residual stream, and the FFN filter gates."""

    hidden: bool = True
    """Hidden-dimension gates, one per layer group, besides the FFN filter gates (false: filters only)."""
    mask_steps: int = Field(100, ge=1)
    """Optimizer steps with the masks (after ``finetune_steps``); then they are binarised and fused."""
    kept_value: Literal["trained", "one"] = "trained"
    """What a kept mask entry is fused as: trained (its deterministic value, sigmoid(log alpha) stretched and
    clamped, usually below 1: SP3 §3.3) or one (the 0/1 mask alone: kept units keep their weights unscaled), to
    separate the fractional values (sp3-llm's D5) from the training budget."""

    @model_validator(mode="after")
    def _prior_needs_hidden(self) -> StreamMaskSettings:
        if self.rank_prior > 0 and not self.hidden:
            raise ValueError(f"rank_prior: {self.rank_prior:g} tilts the hidden gates; hidden: false has none")
        return self

    @property
    def total_steps(self) -> int:
        return self.finetune_steps + self.mask_steps

    def schedule(self) -> MaskSchedule:
        return MaskSchedule.sp3(
            1,
            finetune_epochs=self.finetune_steps,
            dimension_epochs=self.mask_steps,
            joint_epochs=0,
            head=False,
            layer=False,
            warmup_epochs=self.warmup_steps,
        )


class EncoderMaskSettings(MaskSettings):
    """SP3's (or CoFi's) masks on a post-norm encoder: hidden, FFN-filter, MHA-intermediate, head and layer gates."""

    hidden: EncoderHidden = "per_norm"
    """per_norm: one gate per hidden LayerNorm (needs pca_project_post first); shared: CoFi's one mask."""
    head: bool = True
    """Attention-head gates, joining in the joint stage (false: heads are kept)."""
    layer: bool = True
    """Whole-block gates z_MHA, z_FFN, joining in the joint stage (false: blocks are kept)."""
    intermediate: bool = False
    """SP3's MHA-intermediate masks (Eqs. 10-13): every head is first projected at full width (V/O by SVD, Q/K by
    DRONE, from the calibration data), then one gate per projected q/k dimension (shared by q and k) and one per
    v/o dimension (shared by v and o) train with the dimension masks; each head keeps its own widths when fused."""
    intermediate_basis: Literal["pca", "identity"] = "pca"
    """What the MHA-intermediate gates act on: pca, the heads projected by Eqs. 10-12 first; identity, the raw head
    dimensions unprojected (SP3's Table 3 ablation: the projection matrices as identities)."""
    dimension_steps: int = Field(100, ge=0)
    """Steps with hidden and FFN-filter gates (D.2: epochs 3-7)."""
    joint_steps: int = Field(100, ge=0)
    """Steps with head and layer gates too (D.2: from epoch 8; §3.2: 15 epochs)."""
    learning_rate: float = Field(2e-5, ge=0)
    """Weights' AdamW learning rate (0: train the masks only; the paper: 2e-5 for BERT)."""

    @model_validator(mode="after")
    def _some_mask_steps(self) -> EncoderMaskSettings:
        if self.dimension_steps + self.joint_steps < 1:
            raise ValueError("dimension_steps + joint_steps must be >= 1")
        joining = [name for name in ("head", "layer") if getattr(self, name)]
        if joining and self.joint_steps < 1:
            raise ValueError(
                f"joint_steps: 0 leaves the {' and '.join(joining)} gates untrained (they join in the joint stage); "
                f"give joint_steps >= 1, or {': false and '.join(joining)}: false for dimension masks only"
            )
        return self

    @model_validator(mode="after")
    def _prior_needs_pca_gates(self) -> EncoderMaskSettings:
        if self.rank_prior > 0 and self.hidden != "per_norm":
            raise ValueError(
                f"rank_prior: {self.rank_prior:g} orders gates by principal-component rank, which needs "
                f"hidden: per_norm (after pca_project_post); hidden: {self.hidden} has none: set rank_prior: 0"
            )
        return self

    @property
    def total_steps(self) -> int:
        return self.finetune_steps + self.dimension_steps + self.joint_steps

    def schedule(self) -> MaskSchedule:
        return MaskSchedule.sp3(
            1,
            finetune_epochs=self.finetune_steps,
            dimension_epochs=self.dimension_steps,
            joint_epochs=self.joint_steps,
            head=self.head,
            layer=self.layer,
            warmup_epochs=self.warmup_steps,
        )


__all__ = ["EncoderHidden", "EncoderMaskSettings", "MaskSettings", "StreamMaskSettings"]
