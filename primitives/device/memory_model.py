"""Memory a compression stage needs, estimated from the model's config and the calibration settings alone.

Method note: docs/methods/devices-offload.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slimkit.primitives.arch.mixers import hybrid_part_params

GIB = 2**30
FLOAT32 = 4
FLOAT64 = 8


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder LM's config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True
    experts: int = 0
    """Routed experts per layer of a mixture-of-experts model (0: a dense MLP of ``intermediate``); each is a gated
    MLP of ``intermediate`` channels (the expert width) with a router row."""
    shared_expert: int = 0
    """Width of a shared expert beside the routed ones (Qwen2-MoE; 0: none)."""
    dense_layers: int = 0
    """Layers of a mixture-of-experts model built with a dense MLP of ``dense_intermediate`` channels instead
    (DeepSeek-V3's first layers, Llama 4's interleaved dense layers)."""
    dense_intermediate: int = 0
    latent_attention: int = 0
    """Weights of one multi-head latent attention (DeepSeek-V3: q_a, q_b, kv_a, kv_b, o and the two latent norms);
    0: q, k, v and o of ``heads`` and ``kv_heads``."""
    expert_biases: bool = False
    """Each expert has gate/up and down biases and the router a bias (GPT-OSS)."""
    layer_totals: tuple[int, int, int] | None = None
    """A hybrid's parameters of token mixing (attention and its gated DeltaNet / Mamba-2 mixers), of the feed-forward
    blocks and of the norms, summed over its layers and counted exactly (its layers differ:
    :func:`~slimkit.primitives.arch.mixers.hybrid_part_params`); None: every layer holds q/k/v/o and the MLP above."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (or anything with the same attribute names)."""
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        experts = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
        width = getattr(config, "moe_intermediate_size", None) if experts else None
        extra = _moe_layout(config, experts, int(width or config.intermediate_size), hidden)
        return cls(
            hidden=hidden,
            intermediate=int(width or config.intermediate_size),
            experts=experts,
            **{"shared_expert": int(getattr(config, "shared_expert_intermediate_size", None) or 0) if experts else 0}
            | extra,
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", True)),
            layer_totals=hybrid_part_params(config),
        )

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """q, k, v, o weights of one layer (a latent attention's weights where the model has one; a hybrid's mean
        token-mixing parameters per layer)."""
        if self.layer_totals is not None:
            return self.layer_totals[0] // self.layers
        if self.latent_attention:
            return self.latent_attention
        return self.hidden * (2 * self.q_width + 2 * self.kv_width)

    def mlp_params(self) -> int:
        """gate, up, down weights of one layer (of every expert, with the router and a shared expert and its gate,
        in a MoE layer; a hybrid's mean per layer)."""
        if self.layer_totals is not None:
            return self.layer_totals[1] // self.layers
        if self.experts:
            shared = (3 * self.shared_expert + 1) * self.hidden if self.shared_expert else 0
            biases = self.experts * (2 * self.intermediate + self.hidden + 1) if self.expert_biases else 0
            return self.experts * (3 * self.intermediate + 1) * self.hidden + shared + biases
        return 3 * self.hidden * self.intermediate

    def layer_params(self) -> int:
        if self.layer_totals is not None:
            return sum(self.layer_totals) // self.layers
        return self.attention_params() + self.mlp_params() + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        head = 0 if self.tied else self.embedding_params()
        if self.layer_totals is not None:
            return self.embedding_params() + head + sum(self.layer_totals) + self.hidden
        dense = self.dense_layers * (self.mlp_params() - 3 * self.hidden * self.dense_intermediate)
        return self.embedding_params() + head + self.layers * self.layer_params() - dense + self.hidden


def _moe_layout(config: Any, experts: int, width: int, hidden: int) -> dict[str, Any]:
    """What the families released since add to a shape: dense layers among the routed ones, shared experts whose width
    the config gives as a count, latent attention, expert biases (read from the config's own keys)."""
    extra: dict[str, Any] = {}
    if experts:
        layers = int(config.num_hidden_layers)
        dense_first = int(getattr(config, "first_k_dense_replace", None) or 0)
        routed = getattr(config, "moe_layers", None)
        extra["dense_layers"] = dense_first or (layers - len(routed) if isinstance(routed, list | tuple) else 0)
        if extra["dense_layers"]:
            extra["dense_intermediate"] = int(
                getattr(config, "intermediate_size_mlp", None) or getattr(config, "intermediate_size", None) or 0
            )
        shared = getattr(config, "n_shared_experts", None)
        if shared:
            extra["shared_expert"] = int(shared) * width
        elif getattr(config, "model_type", None) == "llama4_text":  # Llama 4: one shared expert of the expert width
            extra["shared_expert"] = width
        extra["expert_biases"] = getattr(config, "model_type", None) == "gpt_oss"
    q_rank, kv_rank = getattr(config, "q_lora_rank", None), getattr(config, "kv_lora_rank", None)
    if kv_rank:
        heads = int(config.num_attention_heads)
        nope, rope, value = (int(getattr(config, k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        query = hidden * heads * (nope + rope) if not q_rank else q_rank * (hidden + 1 + heads * (nope + rope))
        keys = hidden * (kv_rank + rope) + kv_rank * (1 + heads * (nope + value))
        extra["latent_attention"] = query + keys + heads * value * hidden
    return extra


def weights_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    return shape.total_params() * dtype_bytes


FULL_TRAINING_BYTES = 5 * FLOAT32
"""Bytes per trained parameter of full-parameter training: the float32 weight, its gradient, AdamW's two moments and
the last good copy kept against divergence."""


def full_training_bytes(params: int, world: int = 1) -> int:
    """Per device, the float32 training state (:data:`FULL_TRAINING_BYTES` a parameter) of ``params`` parameters
    sharded over ``world`` processes (each holds ``ceil(params / world)`` of them; 1: replicated)."""
    return -(-params // world) * FULL_TRAINING_BYTES


def root_unit_params(shape: ModelShape) -> int:
    """Parameters of a sharded model's root unit: the embeddings, an untied head and the final norm."""
    return (1 if shape.tied else 2) * shape.embedding_params() + shape.hidden


def gathered_params(shape: ModelShape) -> int:
    """Parameters a sharded model holds gathered: its root unit (FSDP keeps it gathered once its forward has run)
    and two decoder layers (the one computing and the one prefetched)."""
    return root_unit_params(shape) + 2 * shape.layer_params()


def gathered_unit_bytes(shape: ModelShape, dtype_bytes: int = FLOAT32) -> int:
    """What a sharded model holds gathered beside its shards: the root unit (the embeddings, an untied head, the
    final norm: FSDP keeps the root gathered from its forward through its backward) and two decoder layers (the one
    computing and the one prefetched), as weights and gradients in the compute dtype (``dtype_bytes``: a half-precision
    model gathers in its dtype), and then the float32 copy of the larger unit's gradients the reduction makes."""
    gathered = gathered_params(shape) * 2 * dtype_bytes
    return gathered + (max(root_unit_params(shape), shape.layer_params()) * FLOAT32 if dtype_bytes < FLOAT32 else 0)


def gradient_sum_bytes(params: int, squares: bool) -> int:
    """float32 sum of gradients (and of their squares) of ``params`` parameters."""
    return params * FLOAT32 * (2 if squares else 1)


def adamw_training_bytes(params: int, dtype_bytes: int) -> dict[str, int]:
    """Training every one of ``params`` weights with AdamW through float32 masters (``FloatMaster``): their
    gradients in the weights' dtype, for half-precision weights the float32 masters and the masters' gradients,
    and AdamW's two float32 moments."""
    parts = {"weight gradients": params * dtype_bytes}
    if dtype_bytes < FLOAT32:
        parts["float32 masters and their gradients"] = 2 * params * FLOAT32
    parts["AdamW moments"] = 2 * params * FLOAT32
    return parts


def layer_activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """What one decoder layer's backward keeps for ``tokens`` tokens (see the module docstring)."""
    per_token = 6 * shape.hidden + 2 * shape.q_width + 2 * shape.kv_width + 4 * shape.intermediate
    return tokens * (per_token * dtype_bytes + 2 * shape.hidden * FLOAT32)


def logits_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, backward: bool) -> int:
    """The logits in the weights' dtype, their float32 copy for the loss, and its gradient in a backward."""
    return tokens * shape.vocab * (dtype_bytes + FLOAT32 * (2 if backward else 1))


def backward_activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpoint_layers: bool) -> int:
    """Activations the calibration backward holds at its peak: every layer's saved tensors and the logits; with
    ``checkpoint_layers``, every layer's input and the larger of the logits (freed once the head's backward is
    done) and one recomputed layer's saved tensors."""
    logits = logits_bytes(shape, tokens, dtype_bytes, backward=True)
    if checkpoint_layers:
        inputs = shape.layers * tokens * shape.hidden * dtype_bytes
        return inputs + max(logits, layer_activation_bytes(shape, tokens, dtype_bytes))
    return shape.layers * layer_activation_bytes(shape, tokens, dtype_bytes) + logits


def forward_activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """A forward without gradients: about one layer's intermediates and the logits."""
    return layer_activation_bytes(shape, tokens, dtype_bytes) + logits_bytes(shape, tokens, dtype_bytes, False)


def layer_input_bytes(shape: ModelShape, samples: int, seq_len: int, dtype_bytes: int) -> int:
    """A layer-wise block's hidden states of one layer for every calibration sample (inputs and outputs)."""
    return 2 * samples * seq_len * shape.hidden * dtype_bytes


@dataclass
class StageMemory:
    """One stage's peak memory beside the weights, by part (bytes), and what lowers it."""

    stage: str
    parts: dict[str, int] = field(default_factory=dict)
    advice: str = ""
    host_parts: dict[str, int] = field(default_factory=dict)
    """Parts that live in host memory whatever the device (e.g. gradient sums with ``stats_device: cpu``)."""
    released: int = 0
    """Bytes of the model's resident weights the stage frees while its parts are held (a student trained whole: its
    weights replaced by their float32 training copy, or by this process's shards of it)."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def net(self) -> int:
        """What the stage adds to the weights at its peak: its parts less the weights it releases."""
        return self.total - self.released


@dataclass
class MemoryPlan:
    """The weights and each stage's extra memory; the peak is the weights plus the largest stage (its parts less the
    weights it releases)."""

    weights: int
    stages: list[StageMemory]

    @property
    def peak_stage(self) -> StageMemory | None:
        return max(self.stages, key=lambda s: s.net, default=None)

    @property
    def peak(self) -> int:
        stage = self.peak_stage
        return self.weights + max(0, stage.net if stage is not None else 0)

    def describe(self) -> dict[str, Any]:
        """What the report records (GiB, two decimals): the weights, the peak, the stage that sets it, and each
        stage's total and parts."""
        peak_stage = self.peak_stage
        return {
            "weights_gib": round(self.weights / GIB, 2),
            "peak_gib": round(self.peak / GIB, 2),
            "peak_stage": peak_stage.stage if peak_stage is not None and peak_stage.net > 0 else None,
            "stages": [
                {
                    "stage": s.stage,
                    "total_gib": round(s.total / GIB, 2),
                    "parts_gib": {name: round(value / GIB, 2) for name, value in s.parts.items()},
                    "released_gib": round(s.released / GIB, 2),
                }
                for s in self.stages
            ],
        }

    def refusal(self, device: str, available: int) -> str | None:
        """The one-line refusal when the peak exceeds ``available`` bytes on ``device``, else None."""
        if self.peak <= available:
            return None
        stage = self.peak_stage
        name = stage.stage if stage is not None and stage.net > 0 else "the model"
        parts = [("weights", self.weights), *((stage.parts.items()) if stage is not None else ())]
        listed = ", ".join(f"{part} {value / GIB:.1f}" for part, value in parts if value > 0)
        if stage is not None and stage.released:
            listed += f"; less the weights it releases, {stage.released / GIB:.1f}"
        advice = f"; {stage.advice}" if stage is not None and stage.advice else ""
        return (
            f"{name} needs about {self.peak / GIB:.1f} GiB on {device} ({listed}) and {device} has "
            f"{available / GIB:.1f} GiB{advice}"
        )


__all__ = [
    "FULL_TRAINING_BYTES",
    "GIB",
    "MemoryPlan",
    "ModelShape",
    "StageMemory",
    "adamw_training_bytes",
    "backward_activation_bytes",
    "forward_activation_bytes",
    "full_training_bytes",
    "gathered_params",
    "gathered_unit_bytes",
    "gradient_sum_bytes",
    "layer_activation_bytes",
    "layer_input_bytes",
    "logits_bytes",
    "root_unit_params",
    "weights_bytes",
]
