"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) as architecture data, and its widths read from shapes.

MLA computes queries through a low-rank pair with a norm between, ``q = q_b(norm(q_a x))``, and keys and values from
one latent: ``kv_a`` writes ``kv_lora_rank`` latent channels (normalised by ``kv_a_layernorm``) and the rotary key
channels every head shares; ``kv_b`` expands the latent into each head's non-rotary key and its value. Its units (heads,
query and key-value latent channels) are built in :mod:`slimkit.primitives.groups.latent`; the attention reads
``kv_lora_rank`` from its own attribute (:func:`sync_latent_attention`). Method note: docs/methods/architectures.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LatentAttention:
    """Where an MLA attention's parts are, relative to the attention module, and the attributes it reads."""

    q_a: str = "q_a_proj"
    q_a_norm: str = "q_a_layernorm"
    q_b: str = "q_b_proj"
    kv_a: str = "kv_a_proj_with_mqa"
    kv_a_norm: str = "kv_a_layernorm"
    kv_b: str = "kv_b_proj"
    o: str = "o_proj"
    nope_attr: str = "qk_nope_head_dim"
    rope_attr: str = "qk_rope_head_dim"
    value_attr: str = "v_head_dim"
    q_rank_key: str = "q_lora_rank"
    kv_rank_key: str = "kv_lora_rank"


@dataclass(frozen=True)
class LatentWidths:
    """One MLA attention's widths, read from its tensors."""

    heads: int
    nope: int
    rope: int
    value: int
    q_rank: int
    kv_rank: int

    @property
    def query_head(self) -> int:
        """Rows of ``q_b`` one head takes (its non-rotary and rotary parts)."""
        return self.nope + self.rope

    @property
    def kv_head(self) -> int:
        """Rows of ``kv_b`` one head takes (its non-rotary key part and its value)."""
        return self.nope + self.value


def part(attention: nn.Module, path: str) -> nn.Module:
    return attention.get_submodule(path)


def latent_widths(attention: nn.Module, latent: LatentAttention) -> LatentWidths:
    """Head count and latent ranks from the tensors (the head widths from the module's attributes)."""
    nope = int(getattr(attention, latent.nope_attr))
    rope = int(getattr(attention, latent.rope_attr))
    value = int(getattr(attention, latent.value_attr))
    q_b = part(attention, latent.q_b)
    return LatentWidths(
        heads=int(q_b.weight.shape[0]) // (nope + rope),
        nope=nope,
        rope=rope,
        value=value,
        q_rank=int(q_b.weight.shape[1]),
        kv_rank=int(part(attention, latent.kv_a_norm).weight.shape[0]),
    )


def config_entries(widths: LatentWidths, latent: LatentAttention) -> dict[str, int]:
    """The config entries of one layer's attention (what ``per_layer_config`` records)."""
    return {
        "num_attention_heads": widths.heads,
        "num_key_value_heads": widths.heads,
        "head_dim": widths.rope,  # the config's head_dim is the rotary width (what the rotary embedding reads)
        latent.q_rank_key: widths.q_rank,
        latent.kv_rank_key: widths.kv_rank,
    }


def sync_latent_attention(attention: nn.Module, latent: LatentAttention) -> None:
    """Write the head count and latent ranks the forward reads into the attention's attributes."""
    widths = latent_widths(attention, latent)
    values = {
        "num_heads": widths.heads,
        "num_key_value_groups": 1,  # every head has its own key and value (expanded from the latent)
        latent.q_rank_key: widths.q_rank,
        latent.kv_rank_key: widths.kv_rank,
    }
    for name, value in values.items():
        if hasattr(attention, name):
            setattr(attention, name, value)


__all__ = [
    "LatentAttention",
    "LatentWidths",
    "config_entries",
    "latent_widths",
    "sync_latent_attention",
]
