"""Rewriting a weight in a new basis (``times_basis``, ``scale_columns``) a block of rows at a time in float64: the
same matrix as the whole-matrix float64 product, and no float64 copy of the whole matrix on the way."""

from __future__ import annotations

import torch

from slimkit.primitives.evaluate.tensor_bytes import LiveTensorBytes
from slimkit.primitives.projection import norms
from slimkit.primitives.projection.norms import by_row_blocks, scale_columns, times_basis


def test_blocks_give_the_whole_matrix_product(monkeypatch):
    monkeypatch.setattr(norms, "BLOCK_ROWS", 3)  # 10 rows: blocks of 3, 3, 3 and 1
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=generator, dtype=torch.float32)
    basis = torch.linalg.qr(torch.randn(6, 4, generator=generator, dtype=torch.float64))[0]
    gamma = torch.rand(6, generator=generator) + 0.5
    expected = ((weight.double() * gamma.double()[None, :]) @ basis).float()
    assert torch.equal(times_basis(weight, basis, gamma), expected)
    assert torch.equal(times_basis(weight, basis), (weight.double() @ basis).float())
    assert torch.equal(scale_columns(weight, gamma), (weight.double() * gamma.double()[None, :]).float())
    half = weight.bfloat16()
    assert times_basis(half, basis).dtype == torch.bfloat16
    by_hand = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert torch.equal(
        by_row_blocks(by_hand, 1, lambda b: b.sum(dim=1, keepdim=True)), torch.tensor([[3.0], [7.0], [11.0]])
    )


def test_an_embedding_sized_rewrite_holds_one_new_matrix_and_a_block(monkeypatch):
    """A 20,000 x 64 float32 matrix (5 MB): the rewrite adds the new matrix and one block's float64 work, not the
    two whole float64 matrices (20 MB) a whole-matrix product makes."""
    monkeypatch.setattr(norms, "BLOCK_ROWS", 1024)
    weight = torch.randn(20_000, 64)
    basis = torch.eye(64, dtype=torch.float64)[:, :48]
    gamma = torch.ones(64)
    with LiveTensorBytes() as live:
        result = times_basis(weight, basis, gamma)
    new_matrix = 20_000 * 48 * 4
    block_work = 1024 * 64 * 8 * 3  # the block in float64, scaled, and its product (at most)
    assert live.peak <= new_matrix + weight.numel() * 4 + block_work  # a view of the weight may count its storage
    assert live.peak < 2 * 20_000 * 64 * 8  # far below two whole float64 matrices
    assert torch.equal(result, weight[:, :48])
