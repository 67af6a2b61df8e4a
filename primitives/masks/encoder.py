"""SP3's learned masks on a post-norm encoder (BERT) for a GLUE task: train, binarise, fuse (§3.2, §3.3, App. C, D.2).

:func:`train_encoder_masks` is the BERT analogue of :func:`~slimkit.primitives.masks.stream.train_stream_masks`.

Method note: docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from slimkit.primitives.arch import ModelView
from slimkit.primitives.arch.head_widths import head_width_refusal
from slimkit.primitives.device.moves import input_device, to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.masks.hooks import apply_masks
from slimkit.primitives.masks.mask_set import MaskSet, MaskShape, MaskValues, apply_rank_prior
from slimkit.primitives.masks.mask_settings import EncoderHidden, EncoderMaskSettings
from slimkit.primitives.masks.sparsity import binarize, dense_size, expected_size
from slimkit.primitives.masks.training import MaskTarget, run_settings, train_masks
from slimkit.primitives.projection.adapters import basis_change_params
from slimkit.primitives.projection.heads import project_heads, slice_heads
from slimkit.primitives.projection.norms import linear_param, set_param
from slimkit.primitives.projection.postnorm import hidden_norms, slice_post_norm_hidden
from slimkit.primitives.surgery import prune_layer, remove_units

Batch = Mapping[str, torch.Tensor]


# -- what a model can take ----------------------------------------------------------------------------------
def check_encoder_masks(model: nn.Module, settings: EncoderMaskSettings) -> None:
    """Refuse in one line (naming the setting) mask levels the model cannot take, before any compute."""
    view = ModelView(model)
    kind = view.spec.model_type
    if settings.intermediate:
        reason = head_width_refusal(view.spec)
        if reason is None and any(layer.num_kv_heads != layer.num_heads for layer in view.layers):
            reason = f"this {kind} model shares KV heads between query heads"
        if reason is not None:
            raise SlimkitError(
                f"intermediate: true (SP3's MHA-intermediate masks) cannot apply: {reason}; set intermediate: false"
            )
    if view.spec.norm_placement != "post":
        if settings.layer:
            raise SlimkitError(
                f"layer: true (block masks z_MHA, z_FFN on a post-norm encoder) has no blocks to mask in this {kind} "
                "model (pre-norm); set layer: false, or use mask_train"
            )
        raise SlimkitError(f"needs a post-norm encoder (BERT); this model is a pre-norm {kind}: use mask_train")
    uneven = [layer.index for layer in view.layers if layer.head_widths is not None]
    if uneven:
        raise SlimkitError(
            f"needs heads of one width; layer(s) {', '.join(map(str, uneven))} already keep per-head widths "
            "(fused MHA-intermediate masks): train masks before fusing them, once"
        )


# -- counting ---------------------------------------------------------------------------------------------
def residual_mode(hidden: EncoderHidden) -> str:
    """Eq. 30's residual term: dense W_R per block with per-norm masks (projected model), none otherwise."""
    return "dense" if hidden == "per_norm" else "none"


def counted_weights(model: nn.Module) -> int:
    """The fused model's weights that Eq. 30 counts: q, k, v, o, up, down matrices plus residual matrices."""
    view = ModelView(model)
    total = 0
    for layer in view.layers:
        for role in layer.roles:
            owner, name = linear_param(layer.linear(role), "weight", 0)
            total += getattr(owner, name).numel()
    return total + basis_change_params(model)


def is_projected(model: nn.Module) -> bool:
    """True when every hidden norm is an RMSNorm (:func:`~slimkit.primitives.projection.project_post_norm`)."""
    return all(isinstance(model.get_submodule(p), nn.RMSNorm) for p in hidden_norms(model))


# -- fusing -----------------------------------------------------------------------------------------------
def _scale_linear(module: nn.Module, factor: torch.Tensor, columns: bool) -> None:
    """Multiply a Linear's columns (``columns``) or its rows and bias by ``factor`` (a vector or a scalar)."""
    owner, name = linear_param(module, "weight", 1 if columns else 0)
    weight = getattr(owner, name).detach()
    f = factor.to(weight.device, torch.float64)  # folded in float64; set_param keeps the weight's dtype
    set_param(owner, name, weight.double() * (f[None, :] if columns and f.dim() else f[:, None] if f.dim() else f))
    if not columns:
        bias_owner, bias_name = linear_param(module, "bias", 0)
        bias = getattr(bias_owner, bias_name)
        if bias is not None:
            set_param(bias_owner, bias_name, bias.detach().double() * f)


def _keep_or_placeholder(z: torch.Tensor) -> tuple[torch.Tensor, bool]:
    keep = (z != 0).nonzero().flatten().cpu()  # a small index list; surgery indexes on the CPU
    if keep.numel() == 0:
        return torch.zeros(1, dtype=torch.long), True
    return keep, False


@dataclass(frozen=True)
class LayerKeep:
    """What fusing keeps of one layer for 0/1 mask values (:func:`layer_keep`): the heads, per kept head its q/k and
    v/o dimensions, the FFN filters, and which of them are exact zero placeholders (a layer losing every head keeps
    head 0; one whose kept heads keep no q/k (v/o) dimension keeps dimension 0; one losing every filter keeps one)."""

    heads: torch.Tensor
    qk: list[torch.Tensor]
    vo: list[torch.Tensor]
    filters: torch.Tensor
    placeholder_heads: bool
    placeholder_qk: bool
    placeholder_vo: bool
    placeholder_filters: bool


def layer_keep(values: MaskValues, i: int, heads: int, head_dim: int, filters: int) -> LayerKeep:
    """Layer ``i``'s :class:`LayerKeep` under ``values`` (absent fields keep everything); the one rule that
    :func:`fuse_encoder_masks` applies and :func:`placeholder_size` counts."""

    def field(name: str, full: torch.Tensor) -> torch.Tensor:
        value = getattr(values, name)
        return full if value is None else value[i].detach().cpu()

    kept_heads, no_heads = _keep_or_placeholder(field("head", torch.ones(heads)) * field("mha", torch.ones(())))
    qk, no_qk = _head_dims_kept(values.qk[i].detach().cpu() if values.qk is not None else None, kept_heads, head_dim)
    vo, no_vo = _head_dims_kept(values.vo[i].detach().cpu() if values.vo is not None else None, kept_heads, head_dim)
    kept_filters, no_filters = _keep_or_placeholder(field("f", torch.ones(filters)) * field("ffn", torch.ones(())))
    return LayerKeep(kept_heads, qk, vo, kept_filters, no_heads, no_qk, no_vo, no_filters)


def placeholder_size(values: MaskValues, shape: MaskShape) -> float:
    """The counted weights :func:`fuse_encoder_masks` keeps as exact zero placeholders (:class:`LayerKeep`) for 0/1
    ``values``, which Eq. 30 counts as removed. The final selection counts them, so the fused model lands on the
    target."""
    extra = 0.0
    d, dh = shape.hidden, shape.head_dim

    def kept(field: list[torch.Tensor] | None, i: int, full: int) -> float:
        return float(full) if field is None else float((field[i] != 0).sum())

    for i in range(shape.num_layers):
        n_in, n_out = kept(values.mha_in, i, d), kept(values.mha_out, i, d)
        keep = layer_keep(values, i, shape.heads[i], dh, shape.ffn[i])
        if keep.placeholder_heads:  # the fused layer keeps head 0 at the widths its dimension masks leave
            extra += (2 * keep.qk[0].numel() + keep.vo[0].numel()) * n_in + keep.vo[0].numel() * n_out
        else:
            extra += 2 * n_in * keep.placeholder_qk + (n_in + n_out) * keep.placeholder_vo
        if keep.placeholder_filters:
            n_in2, n_out2 = kept(values.ffn_in, i, d), kept(values.ffn_out, i, d)
            extra += n_in2 * (2 if shape.gated else 1) + n_out2
    return extra


def _norm_values(values: MaskValues, num_layers: int) -> list[torch.Tensor] | None:
    """z_0 .. z_2L from per-norm fields (checks ``mha_out[i] == ffn_in[i]``)."""
    if values.mha_in is None and values.mha_out is None and values.ffn_in is None and values.ffn_out is None:
        return None
    if any(getattr(values, n) is None for n in ("mha_in", "mha_out", "ffn_in", "ffn_out")):
        raise SlimkitError("per-norm hidden masks need all four hidden fields")
    z = [values.mha_in[0]]
    for i in range(num_layers):
        if not torch.equal(values.mha_out[i], values.ffn_in[i]):
            raise SlimkitError(f"layer {i}: mha_out and ffn_in mask the same norm and must be equal")
        if i + 1 < num_layers and not torch.equal(values.ffn_out[i], values.mha_in[i + 1]):
            raise SlimkitError(f"layer {i}: ffn_out and the next layer's mha_in mask the same norm and must be equal")
        z += [values.mha_out[i], values.ffn_out[i]]
    return [t.detach() for t in z]


def _head_dims_kept(z: torch.Tensor | None, heads: torch.Tensor, head_dim: int) -> tuple[list[torch.Tensor], bool]:
    """Per kept head, the dimensions ``z`` (``[heads, head_dim]``) keeps; when none in the layer, dimension 0 of the
    first head (its rows were scaled to zero: an exact placeholder) and True."""
    if z is None:
        return [torch.arange(head_dim) for _ in heads], False
    kept = [(z[h] != 0).nonzero().flatten().cpu() for h in heads.tolist()]
    if sum(k.numel() for k in kept) == 0:
        kept[0] = torch.zeros(1, dtype=torch.long)
        return kept, True
    return kept, False


def fuse_encoder_masks(
    model: nn.Module, values: MaskValues, hidden: EncoderHidden, scores: Sequence[torch.Tensor] | None = None
) -> dict:
    """Fold final mask values into a BERT model and remove what they zero, in place (module docstring).

    ``hidden``: ``per_norm`` (projected model, per-norm 0/1 hidden masks sliced exactly), ``shared``
    (unprojected model, one 0/1 hidden mask, LayerNorms sliced directly) or ``none``. ``scores``
    (per-norm ``log α``) pick the coordinate kept when a norm's mask is all zero. The shared MHA-intermediate
    masks ``qk`` and ``vo`` are folded into the q and v rows (the side the hooks mask) and the dimensions they zero
    are removed per head (:func:`~slimkit.primitives.projection.heads.slice_heads`): heads keep their own widths.
    """
    if values.q is not None or values.k is not None or values.v is not None or values.o is not None:
        raise SlimkitError(
            "separate masks inside heads (q, k, v, o) are not supported on encoders; use the shared qk and vo masks"
        )
    view = ModelView(model)
    n = view.num_layers
    report: dict = {
        "placeholder_heads": [],
        "placeholder_filters": [],
        "forced_hidden": [],
        "head_widths": {},
        "placeholder_head_dims": [],
    }
    on = next((t.device for _name, field in values.items() for t in field), torch.device("cpu"))  # masks' device
    with torch.no_grad():
        for i in range(n):
            layer = view.layer(i)
            heads, dh = layer.num_heads, layer.head_dim
            o, down = layer.linear("o"), layer.linear("down")
            z_head = values.head[i].detach() if values.head is not None else torch.ones(heads, device=on)
            z_mha = values.mha[i].detach() if values.mha is not None else torch.ones((), device=on)
            z_qk = values.qk[i].detach() if values.qk is not None else None
            z_vo = values.vo[i].detach() if values.vo is not None else None
            if z_qk is not None:
                _scale_linear(layer.linear("q"), z_qk.flatten(), columns=False)
            if z_vo is not None:
                _scale_linear(layer.linear("v"), z_vo.flatten(), columns=False)
            _scale_linear(o, z_head.repeat_interleave(dh), columns=True)
            _scale_linear(o, z_mha, columns=False)
            z_f = values.f[i].detach() if values.f is not None else torch.ones(layer.mlp_width, device=on)
            z_ffn = values.ffn[i].detach() if values.ffn is not None else torch.ones((), device=on)
            _scale_linear(down, z_f, columns=True)
            _scale_linear(down, z_ffn, columns=False)
            keep = layer_keep(values, i, heads, dh, layer.mlp_width)
            if keep.placeholder_heads:
                report["placeholder_heads"].append(i)
            if keep.heads.numel() < heads:
                prune_layer(model, "attention_head", i, keep.heads)
            if z_qk is not None or z_vo is not None:
                if keep.placeholder_qk or keep.placeholder_vo:
                    report["placeholder_head_dims"].append(i)
                widths = slice_heads(model, i, keep.qk, keep.vo)
                report["head_widths"][str(i)] = {"qk": list(widths.qk), "vo": list(widths.vo)}
            if keep.placeholder_filters:
                report["placeholder_filters"].append(i)
            if keep.filters.numel() < layer.mlp_width:
                prune_layer(model, "mlp_channel", i, keep.filters)
            view = ModelView(model)
        if hidden == "per_norm":
            z = _norm_values(values, n)
            if z is not None:
                keep = []
                for j, zj in enumerate(z):
                    k = (zj != 0).nonzero().flatten().cpu()
                    if k.numel() == 0:
                        best = int(scores[j].argmax()) if scores is not None else 0
                        k = torch.tensor([best])
                        report["forced_hidden"].append(j)
                    keep.append(k)
                report.update(slice_post_norm_hidden(model, keep))
        elif hidden == "shared" and values.mha_in is not None:
            z = values.mha_in[0].detach()
            keep = (z != 0).nonzero().flatten().cpu()
            if keep.numel() == 0:
                keep = torch.tensor([int(scores[0].argmax()) if scores is not None else 0])
                report["forced_hidden"].append(0)
            if keep.numel() < z.numel():
                remove_units(model, build_groups(model, "hidden_feature")[0], keep)
                pooler = getattr(ModelView(model).base, "pooler", None)
                if pooler is not None:  # the hidden-feature group stops at the last norm; the pooler reads it
                    owner, name = linear_param(pooler.dense, "weight", 1)
                    set_param(owner, name, getattr(owner, name).detach()[:, keep])
            report["widths"] = [int(keep.numel())]
    view = ModelView(model)

    def weights(i: int, roles: Sequence[str]) -> int:
        return sum(getattr(*linear_param(view.layer(i).linear(r), "weight", 0)).numel() for r in roles)

    report["placeholder_params"] = sum(weights(i, ("q", "k", "v", "o")) for i in report["placeholder_heads"]) + sum(
        weights(i, ("up", "down")) for i in report["placeholder_filters"]
    )
    report["counted_weights"] = counted_weights(model)
    return report


# -- training -----------------------------------------------------------------------------------------------
def _distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    if student.shape[-1] == 1:
        return F.mse_loss(student.float(), teacher.float())
    return F.kl_div(
        F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1), log_target=True, reduction="batchmean"
    )


def _agreement(masked: list[torch.Tensor], fused: list[torch.Tensor]) -> dict:
    a, b = torch.cat(masked), torch.cat(fused)
    out = {"max_abs_logit_diff": float((a - b).abs().max())}
    if a.shape[-1] > 1:
        out["prediction_agreement"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return out


def _logits(model: nn.Module, batches: Sequence[Batch]) -> list[torch.Tensor]:
    with torch.no_grad():  # classification logits are small: compared on the CPU in float32
        return [
            model(**to_input_device(model, {k: v for k, v in b.items() if k != "labels"})).logits.detach().float().cpu()
            for b in batches
        ]


def train_encoder_masks(
    model: nn.Module,
    batches: Sequence[Batch],
    settings: EncoderMaskSettings,
    target: float,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    check_batches: Sequence[Batch] | None = None,
    tolerance: float = 0.005,
    calibration: Sequence[Batch | torch.Tensor] | None = None,
) -> dict:
    """Train, binarise and fuse SP3's (or CoFi's) masks on a GLUE task model in place; returns a report.

    ``batches``: tokenised GLUE batches with ``labels`` (:func:`slimkit.primitives.datasets.gluedata.encode`),
    one per optimiser step, reused cyclically when fewer. ``check_batches`` (optional): batches on
    which the masked (binary masks) and the fused model are compared (``masked_vs_fused``). ``target``: the
    sparsity to reach under Eq. 30 (attention and FFN matrices, plus residual matrices with per_norm);
    ``tolerance``: the final structure is chosen by the budget-aware selection of
    :func:`~slimkit.primitives.masks.sparsity.select_to_target` over all mask levels, within
    ``[target, target + tolerance]`` where the units allow (a threshold alone overshot with block gates).
    ``calibration``: the batches the MHA-intermediate projections are computed from (``settings.intermediate``;
    default: the training batches without their labels).
    """
    started = time.perf_counter()
    try:
        check_encoder_masks(model, settings)
    except SlimkitError as error:
        raise SlimkitError(f"encoder mask training: {error}") from None
    view = ModelView(model)
    if not batches:
        raise SlimkitError("encoder mask training needs batches")
    projected = is_projected(model)
    if settings.hidden == "per_norm" and not projected:
        raise SlimkitError("hidden: per_norm needs a model projected by project_post_norm (stage pca_project_post)")
    if settings.hidden == "shared" and projected:
        raise SlimkitError("hidden: shared is the masks-only baseline on the unprojected model")
    heads_projection = None
    if settings.intermediate and settings.intermediate_basis == "pca":
        inputs = calibration or [{k: v for k, v in b.items() if k != "labels"} for b in batches]
        heads_projection = {"tokens": project_heads(model, inputs)["tokens"]}
    shape = MaskShape.from_view(view)
    masks = MaskSet(
        shape,
        head=settings.head,
        layer=settings.layer,
        intermediate=False,
        shared_intermediate=settings.intermediate,
        hidden=settings.hidden,
        init_drop=settings.init_drop,
        seed=seed,
    )
    if settings.rank_prior > 0:
        apply_rank_prior(masks, settings.rank_prior)
    residual = residual_mode(settings.hidden)
    total = dense_size(shape)
    goal = MaskTarget(target, total)
    schedule = settings.schedule()
    teacher = copy.deepcopy(model).eval().requires_grad_(False) if settings.distill > 0 else None
    masks.to(input_device(model))  # float32 gates on the model's device

    def step_loss(net: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        batch = to_input_device(net, batch)
        if net is teacher:
            batch.pop("labels", None)
            return torch.zeros((), device=batch["input_ids"].device), net(**batch).logits
        out = net(**batch)
        return out.loss.float(), out.logits

    def size(values: MaskValues) -> torch.Tensor:
        return expected_size(values, shape, residual=residual)

    ends = settings.hidden != "none"
    hooks = apply_masks(model, masks, placement="norm", ends=ends)
    try:
        history, lagrangian = train_masks(
            model,
            masks,
            batches,
            schedule,
            size,
            step_loss,
            settings,
            goal,
            seed=seed,
            teacher=teacher,
            distance=_distill_loss,
            progress=progress,
        )
    finally:
        hooks.remove()
    levels = schedule.levels(settings.total_steps - 1)
    masks.set_active(levels)
    scores = masks.scores()

    def fused_size(values: MaskValues) -> torch.Tensor:  # Eq. 30 plus the zero placeholders the fused model keeps
        return expected_size(values, shape, residual=residual) + placeholder_size(values, shape)

    binary = binarize(scores, shape, target, residual=residual, couple=False, tolerance=tolerance, size=fused_size)
    final = masks.kept_values().times(binary.masks)
    hidden_fields = ("mha_in", "mha_out", "ffn_in", "ffn_out")
    final = MaskValues(**{**final.__dict__, **{h: getattr(binary.masks, h) for h in hidden_fields}})
    masked_logits = None
    if check_batches:
        with apply_masks(model, final, placement="norm", ends=ends):
            masked_logits = _logits(model, check_batches)
    norm_scores = [g.log_alpha.detach() for g in masks.norm_hidden] if masks.norm_hidden is not None else None
    if masks.shared_hidden is not None:
        norm_scores = [masks.shared_hidden.log_alpha.detach()]
    fused = fuse_encoder_masks(model, final, settings.hidden, norm_scores)
    if masked_logits is not None:
        fused["masked_vs_fused"] = _agreement(masked_logits, _logits(model, check_batches))
    seconds = time.perf_counter() - started
    counted = fused["counted_weights"]
    return {
        "steps": settings.total_steps,
        "finetune_steps": settings.finetune_steps,
        "dimension_steps": settings.dimension_steps,
        "joint_steps": settings.joint_steps,
        "levels": sorted(levels),
        "seconds": seconds,
        "seconds_per_step": seconds / max(settings.total_steps, 1),
        "task_loss_first": history["task_loss"][0],
        "task_loss_last": history["task_loss"][-1],
        "expected_sparsity_last": history["expected_sparsity"][-1] if history["expected_sparsity"] else None,
        "lambda_1": float(lagrangian.lambda_1.detach()),
        "lambda_2": float(lagrangian.lambda_2.detach()),
        "threshold": binary.threshold,
        "counted_dense": total,
        "binary_size": binary.size,
        "binary_sparsity": binary.sparsity,
        "counted_weights": counted,
        "achieved_sparsity": 1.0 - counted / total,
        "params": ModelView(model).num_params(),
        "fused": fused,
        "heads_projection": heads_projection,
        "history": history,
        "config": run_settings(settings, EncoderMaskSettings, goal, seed),
    }


__all__ = [
    "check_encoder_masks",
    "counted_weights",
    "fuse_encoder_masks",
    "is_projected",
    "placeholder_size",
    "residual_mode",
    "train_encoder_masks",
]
