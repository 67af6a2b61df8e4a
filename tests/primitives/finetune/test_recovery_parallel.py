"""Data parallelism of the recovery loop: two CPU processes (gloo) sharing each global batch end with the weights of
one process training the same global batches from the same seed, within float32 round-off of summing the gradients
in another order."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.primitives.finetune.recovery_worker import train, worker


@pytest.mark.slow  # two spawned interpreters importing torch, transformers and peft
def test_two_processes_equal_one(tmp_path):
    out = tmp_path / "two.pt"
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=True)
    state, report = train()
    for name, tensor in state.items():
        torch.testing.assert_close(two["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(two["losses"], report["losses"], strict=True):
        assert abs(a - b) < 1e-4
    for a, b in zip(two["validation"], report["validation"], strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-4
