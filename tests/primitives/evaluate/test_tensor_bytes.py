"""primitives/evaluate/tensor_bytes.py: live tensor bytes counted exactly, by hand."""

from __future__ import annotations

import torch

from slimkit.primitives.evaluate.tensor_bytes import LiveTensorBytes


def test_counts_new_storages_once_and_frees_them() -> None:
    weight = torch.ones(1000)  # exists before the block: not counted
    with LiveTensorBytes() as live:
        a = torch.zeros(1000)  # 4,000 bytes
        view = a.view(10, 100)  # a view: the same storage, not counted again
        assert live.now == 4000
        b = torch.ones(500, dtype=torch.float64)  # 4,000 more
        assert live.now == 8000
        del b
        assert live.now == 4000 and live.peak == 8000
        c = weight * 2  # a new 4,000-byte result of an op on an older tensor
        assert live.now == 8000
        del c, view
    assert live.peak == 8000
    assert a.shape == (1000,)
