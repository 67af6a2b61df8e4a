"""What a candidate costs under each budget: parameters removed, memory removed at a context and batch, and the
per-layer latency it adds (read from a measured table, :mod:`.latency`).

Memory is the weights (each at its own dtype) plus the KV cache at ``context`` tokens for ``batch`` sequences:
``2 x kv_heads x head_dim x context x batch x kv_bytes`` per layer with an attention (a removed attention keeps none;
a low-rank attention keeps its heads). A candidate removes its bytes of weights and the cache of the KV heads it drops.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from slimkit.primitives.arch import ModelView


@dataclass(frozen=True)
class MemoryAt:
    """Where memory is counted: the context (tokens per sequence), the batch and the KV cache's bytes per value."""

    context: int
    batch: int = 1
    kv_bytes: int = 2

    def kv_cache(self, kv_heads: int, head_dim: int) -> int:
        """Bytes of one layer's keys and values."""
        return 2 * kv_heads * head_dim * self.context * self.batch * self.kv_bytes


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (tied ones once), each at its own dtype."""
    seen: dict[int, int] = {}
    for tensor in model.parameters():
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def model_memory(model: nn.Module, at: MemoryAt) -> int:
    """The model's weights plus its KV cache at ``at``."""
    view = ModelView(model)
    cache = sum(at.kv_cache(layer.num_kv_heads, layer.head_dim) for layer in view.layers if not layer.attention_removed)
    return weight_bytes(model) + cache


def memory_removed(part: str, removed_bytes: int, dropped_kv_heads: int, head_dim: int, at: MemoryAt) -> int:
    """Bytes a candidate removes: its weights' and, for an attention candidate, the cache of the KV heads it drops."""
    return removed_bytes + (at.kv_cache(dropped_kv_heads, head_dim) if part == "attention" else 0)


__all__ = ["MemoryAt", "memory_removed", "model_memory", "weight_bytes"]
