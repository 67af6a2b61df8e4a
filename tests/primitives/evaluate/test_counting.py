"""primitives/evaluate/counting.py: parameters by part and MACs, counted by hand on tiny models."""

from __future__ import annotations

import torch

from slimkit.primitives.evaluate.counting import count_macs, params_by_part
from slimkit.primitives.surgery import prune_layer


def test_params_by_part_hand_count(llama):
    # hidden 48, 6 heads x 8, 2 kv heads, mlp 64, vocab 300, 3 layers, tied head.
    parts = params_by_part(llama)
    attention = 48 * 48 + 2 * (48 * 16) + 48 * 48
    mlp = 3 * 48 * 64
    assert parts["attention"] == 3 * attention and parts["mlp"] == 3 * mlp
    assert parts["embeddings"] == 300 * 48 and parts["head"] == 0
    assert parts["norms"] == 3 * 2 * 48 + 48
    assert parts["total"] == sum(p.numel() for p in llama.parameters())
    assert parts["layers"] == parts["attention"] + parts["mlp"] + 3 * 2 * 48


def test_macs_follow_pruning(llama):
    seq = 16
    attention_matmuls = 3 * 2 * 6 * 8 * seq
    linear = 3 * (48 * 48 + 2 * 48 * 16 + 48 * 48 + 3 * 48 * 64) + 300 * 48
    assert count_macs(llama, seq) == (linear + attention_matmuls) * seq
    prune_layer(llama, "mlp_channel", 0, torch.arange(32))
    assert count_macs(llama, seq) == (linear - 3 * 48 * 32 + attention_matmuls) * seq


def test_macs_count_residual_matrices(llama):
    from slimkit.primitives.projection import attach_basis_change

    seq = 16
    before = count_macs(llama, seq)
    attach_basis_change(llama.model.layers[1], torch.eye(48))  # a residual matrix on layer 1's input
    assert count_macs(llama, seq) == before + 48 * 48 * seq
