"""What each kind of change can do to each architecture, from its :class:`ArchSpec` alone, and why not where not.

An *operation* is a kind of unit or transform the stages apply (a coupling group kind, the hidden-dimension
projection, whole-block removal, ...). :func:`refusal` gives, for a spec and an operation, None when the change
keeps the model a valid instance of its architecture whose kept parts compute what they did, or the architectural
reason in one phrase. Stages declare the operations they use (``StageArgs.operations``) and refuse through
:func:`check_operations` after loading and before any compute; the primitives check the same rule, so a direct
call refuses alike. The support table (``slimkit stage support``, docs/methods/architectures.md) is generated
from this module.

Derivations per family: docs/methods/architectures.md.
"""

from __future__ import annotations

from typing import Any

from slimkit.primitives.arch.layer_kinds import MIXER_LABELS
from slimkit.primitives.arch.spec import ARCH_SPECS, ArchSpec, removable_blocks
from slimkit.primitives.errors import SlimkitError

OPERATIONS: dict[str, str] = {
    "mlp_channel": "mlp_channel groups",
    "attention_head": "attention_head groups",
    "kv_group": "kv_group groups",
    "qk_dim": "qk_dim groups",
    "vo_dim": "vo_dim groups",
    "hidden_feature": "hidden_feature groups",
    "hidden_projection": "the hidden-dimension projection",
    "hidden_masks": "hidden-dimension masks",
    "blocks": "whole-block removal",
    "expert": "expert units",
    "expert_channel": "expert_channel units",
    "q_latent": "q_latent groups",
    "kv_latent": "kv_latent groups",
    "mlp_policy": "a policy over every layer's MLP",
    "linear_head": "linear_head groups",
    "linear_kv_group": "linear_kv_group groups",
    "mamba_head": "mamba_head groups",
    "mamba_channel": "mamba_channel groups",
}
"""Each operation and how a refusal names it."""


def _embed_scale(spec: ArchSpec) -> str | None:
    if spec.embed_scale_key is None:
        return None
    return (
        f"its embeddings are multiplied by sqrt({spec.embed_scale_key}) taken from the config when the model is "
        "built, so a narrower residual stream would change that scale on reload"
    )


def _post_norms(spec: ArchSpec) -> str | None:
    if not spec.branch_post_norms:
        return None
    names = ", ".join(n for n in (spec.attn_out_norm, spec.mlp_out_norm) if n is not None)
    return (
        f"its branch post-norms ({names}) normalise each branch output over the full hidden width before the "
        "residual sum, so a rotated and truncated stream cannot pass them exactly"
    )


def _branch_scale(spec: ArchSpec) -> str | None:
    if spec.branch_scale_key is None:
        return None
    return (
        f"its {spec.branch_scale_key} scales each branch before the residual sum, which the residual matrices "
        "between projection groups do not carry (the outputs change even at full rank)"
    )


def _offset_norms(spec: ArchSpec) -> str | None:
    if spec.norm_offset == 0.0:
        return None
    return (
        f"its RMSNorms scale by ({spec.norm_offset:g} + w), which folding a norm's scale into the projection's "
        "readers does not express"
    )


def _qk_norms(spec: ArchSpec, inside_heads: bool) -> str | None:
    if not spec.qk_norms:
        return None
    if spec.qk_norm_scope == "projection":
        return (
            "its q/k norms (RMSNorm over the whole q and k projections, every head at once) would normalise the "
            "kept heads by a different statistic; prune mlp_channel, or make the attention low-rank"
        )
    if inside_heads:
        return (
            "its per-head q/k norms (RMSNorm over head_dim) make removing query/key dimensions inside a head "
            "inexact; prune attention_head or kv_group"
        )
    return None


def rotary_fraction(spec: ArchSpec, config: Any) -> float:
    """The fraction of each q/k head RoPE rotates (1.0 unless the spec names a key and the config sets it)."""
    key = spec.rotary_fraction_key
    if key is None or config is None:
        return 1.0
    rope = getattr(config, "rope_parameters", None)
    value = rope.get(key) if isinstance(rope, dict) else None
    value = getattr(config, key, None) if value is None else value
    return 1.0 if value is None else float(value)


def _partial_rotary(spec: ArchSpec, config: Any) -> str | None:
    """Why dimensions inside a q/k head cannot be removed where RoPE rotates only part of each head: with a config,
    only when its fraction is below 1; without one (the support table), the condition in words."""
    if spec.rotary_fraction_key is None or (config is not None and rotary_fraction(spec, config) >= 1.0):
        return None
    return (
        f"where its {spec.rotary_fraction_key} < 1 (Phi-4-mini), RoPE rotates only the first part of each q/k head "
        "(pairs j, j + rotary_dim/2, the rest passed through), so removing query/key dimensions inside a head "
        "changes which dimensions rotate; prune attention_head or kv_group"
    )


def conditional(reason: str) -> bool:
    """Whether a refusal (given without a config) holds only where the config says so (it starts ``where``)."""
    return reason.startswith("where ")


def _routed_experts(spec: ArchSpec) -> str | None:
    if spec.experts is None:
        return None
    return (
        "its MLP is routed experts held as fused tensors, not one gate/up/down projection; prune expert or "
        "expert_channel units (prune_experts, merge_experts, prune_expert_channels)"
    )


def _latent_heads(spec: ArchSpec, operation: str) -> str | None:
    """Why MLA refuses a head-internal or KV-group operation."""
    if spec.latent_attention is None:
        return None
    if operation == "kv_group":
        return (
            "its latent attention expands one key and value per head from the latent (no KV groups); prune "
            "attention_head"
        )
    return (
        "its latent attention's head widths (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) are one config value for "
        "every layer; prune attention_head, q_latent or kv_latent"
    )


def _mixed_mlps(spec: ArchSpec) -> str | None:
    return (
        f"its MLP projections are a dense MLP in some layers and a shared expert ({spec.shared_mlp}) beside routed "
        "experts in others, of different widths, and a policy learner scores one weight shape; prune mlp_channel"
    )


def _no_latent(spec: ArchSpec) -> str | None:
    return "it has no latent attention (MLA)" if spec.latent_attention is None else None


def _dense_mlp(spec: ArchSpec) -> str | None:
    return "it has no routed experts (its MLP is dense)" if spec.experts is None else None


def _no_mixer(spec: ArchSpec, mixer: str) -> str | None:
    """Why units of ``mixer`` layers do not exist in ``spec``'s architecture (None where some layer holds one)."""
    kinds = spec.layer_kinds
    mixers = ("attention",) if kinds is None else kinds.mixers()
    if mixer in mixers:
        return None
    held = ", ".join(MIXER_LABELS[m] for m in mixers)
    return f"it has no {MIXER_LABELS[mixer]} layers (its layers hold {held})"


def _gated_queries(spec: ArchSpec) -> str | None:
    if not spec.q_gate:
        return None
    return (
        "its query projection holds each head's output gate beside its query, and the gate multiplies the value "
        "dimensions, so removing dimensions inside a head is not done; prune attention_head or kv_group"
    )


def _mixers_on_stream(spec: ArchSpec) -> str | None:
    kinds = spec.layer_kinds
    others = [m for m in (kinds.mixers() if kinds else ()) if m != "attention"]
    if not others:
        return None
    return (
        f"its {' and '.join(MIXER_LABELS[m] for m in others)} layers read and write the residual stream through "
        "projections the PCA rotation and the stream masks do not cover (hidden_feature groups do)"
    )


def _encoder(spec: ArchSpec) -> str | None:
    return "it is an encoder (post-norm); use the encoder stages" if spec.encoder else None


def refusal(spec: ArchSpec, operation: str, config: Any = None) -> str | None:
    """None when ``operation`` works on ``spec``'s architecture, else why not (one phrase, no model name).

    ``config``: the loaded model's config, for traits a config decides (a partial rotary fraction); without it a
    refusal that depends on the config is given with its condition."""
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation '{operation}'; allowed: {', '.join(OPERATIONS)}")
    reasons: list[str | None]
    if operation == "attention_head":
        reasons = [_no_mixer(spec, "attention"), _qk_norms(spec, inside_heads=False)]
    elif operation == "kv_group":
        reasons = [_no_mixer(spec, "attention"), _latent_heads(spec, operation), _qk_norms(spec, inside_heads=False)]
    elif operation == "qk_dim":
        reasons = [
            _no_mixer(spec, "attention"),
            _latent_heads(spec, operation),
            _gated_queries(spec),
            _qk_norms(spec, inside_heads=True),
            _partial_rotary(spec, config),
        ]
    elif operation in ("q_latent", "kv_latent"):
        reasons = [_no_latent(spec)]
    elif operation == "mlp_policy":
        reasons = [_routed_experts(spec) if spec.shared_mlp is None else _mixed_mlps(spec)]
    elif operation == "hidden_feature":
        reasons = [_routed_experts(spec), _embed_scale(spec)]
    elif operation in ("linear_head", "linear_kv_group"):
        reasons = [_no_mixer(spec, "gated_deltanet")]
    elif operation in ("mamba_head", "mamba_channel"):
        reasons = [_no_mixer(spec, "mamba2")]
    elif operation in ("hidden_projection", "hidden_masks"):
        reasons = [
            _mixers_on_stream(spec),
            _routed_experts(spec),
            _encoder(spec),
            _post_norms(spec),
            _embed_scale(spec),
            _offset_norms(spec),
            _branch_scale(spec),
        ]
    elif operation == "mlp_channel":  # a routed layer's shared expert (and a dense layer) has MLP channels
        reasons = [_routed_experts(spec) if spec.shared_mlp is None else None]
    elif operation in ("expert", "expert_channel"):
        reasons = [_dense_mlp(spec)]
    elif operation == "blocks":
        reasons = [removable_blocks(spec)]
    else:  # vo_dim: the V/O widths pass no norm
        reasons = [_no_mixer(spec, "attention"), _latent_heads(spec, operation), _gated_queries(spec)]
    return next((reason for reason in reasons if reason is not None), None)


def refusal_message(spec: ArchSpec, operation: str, config: Any = None) -> str | None:
    """``"qk_dim groups are not supported for qwen3: its per-head q/k norms ..."`` (one line), or None."""
    reason = refusal(spec, operation, config)
    if reason is None:
        return None
    label = OPERATIONS[operation]
    verb = "are" if label.endswith("s") else "is"
    return f"{label} {verb} not supported for {spec.model_type}: {reason}"


def spec_of(model: Any) -> ArchSpec | None:
    """The spec of a loaded model (None for an architecture without one; those are refused at loading)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return ARCH_SPECS.get(model_type) if isinstance(model_type, str) else None


def check_operation(spec: ArchSpec, operation: str, config: Any = None) -> None:
    """Raise :class:`SlimkitError` (one line) when ``operation`` is refused for ``spec`` (and ``config``)."""
    message = refusal_message(spec, operation, config)
    if message is not None:
        raise SlimkitError(message)


def check_operations(model: Any, operations: frozenset[str] | set[str] | tuple[str, ...], who: str = "") -> None:
    """Refuse (one line, prefixed by ``who``) the first of ``operations`` the model's architecture cannot take."""
    spec = spec_of(model)
    if spec is None:
        return
    for operation in sorted(operations):
        message = refusal_message(spec, operation, model.config)
        if message is not None:
            raise SlimkitError(f"{who}: {message}" if who else message)


__all__ = [
    "OPERATIONS",
    "check_operation",
    "check_operations",
    "conditional",
    "refusal",
    "refusal_message",
    "rotary_fraction",
    "spec_of",
]
