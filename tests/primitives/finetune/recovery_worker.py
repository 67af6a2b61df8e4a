"""What each spawned process of tests/primitives/finetune/test_recovery_parallel.py runs: an importable module, so
``torch.multiprocessing.spawn`` can unpickle the worker whatever the checkout's folder is called (pytest's importlib
mode names test modules after it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from slimkit.primitives.finetune import LoraConfig
from slimkit.primitives.finetune.recovery import LanguageModelObjective, RecoveryConfig
from slimkit.primitives.finetune.token_recovery import recover_in_tokens
from slimkit.primitives.finetune.token_stream import TextSource
from tests.tiny import byte_tokenizer, tiny_llama

CONFIG = RecoveryConfig(tokens=4 * 4 * 24 - 7, batch_size=4, seq_len=24, learning_rate=5e-3, validation_windows=3)
LORA = LoraConfig(rank=4, dropout=0.0)


def train() -> tuple[dict[str, torch.Tensor], dict]:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tokenizer))
    model, report = recover_in_tokens(model, tokenizer, LORA, CONFIG, TextSource("alpaca"), LanguageModelObjective())
    return model.state_dict(), report


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state, report = train()
        if rank == 0:
            torch.save({"state": state, "losses": report["losses"], "validation": report["validation"]}, out)
    finally:
        dist.destroy_process_group()
