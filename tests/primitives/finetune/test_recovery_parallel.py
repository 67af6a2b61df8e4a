"""Data parallelism of the recovery loop: two CPU processes (gloo) sharing each global batch end with the weights of
one process training the same global batches from the same seed, within float32 round-off of summing the gradients
in another order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slimkit.primitives.finetune import LoraConfig
from slimkit.primitives.finetune.recovery import LanguageModelObjective, RecoveryConfig
from slimkit.primitives.finetune.token_recovery import recover_in_tokens
from slimkit.primitives.finetune.token_stream import TextSource
from tests.tiny import byte_tokenizer, tiny_llama

CONFIG = RecoveryConfig(tokens=4 * 4 * 24 - 7, batch_size=4, seq_len=24, learning_rate=5e-3, validation_windows=3)
LORA = LoraConfig(rank=4, dropout=0.0)


def _train() -> tuple[dict[str, torch.Tensor], dict]:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    model, report = recover_in_tokens(model, tokenizer, LORA, CONFIG, TextSource("alpaca"), LanguageModelObjective())
    return model.state_dict(), report


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state, report = _train()
        if rank == 0:
            torch.save({"state": state, "losses": report["losses"], "validation": report["validation"]}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned interpreters importing torch, transformers and peft
def test_two_processes_equal_one(tmp_path):
    out = tmp_path / "two.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=True)
    state, report = _train()
    for name, tensor in state.items():
        torch.testing.assert_close(two["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(two["losses"], report["losses"], strict=True):
        assert abs(a - b) < 1e-4
    for a, b in zip(two["validation"], report["validation"], strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-4
