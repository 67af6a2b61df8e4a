"""What each spawned process of tests/primitives/finetune/test_full_recovery.py runs: full-parameter distillation of
a pruned tiny student (MLP widths 64, 41, 23: one per layer, odd, so FSDP pads uneven shards) from a tiny teacher,
replicated or sharded; an importable module, so ``torch.multiprocessing.spawn`` can unpickle the worker."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from slimkit.primitives.arch.view import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.full_recovery import recover_all_weights
from slimkit.primitives.finetune.recovery import DistillationObjective, RecoveryConfig
from slimkit.primitives.finetune.sharding import local, shard_model
from slimkit.primitives.finetune.token_stream import TextSource
from slimkit.primitives.groups import layer_group
from slimkit.primitives.surgery.units import remove_units
from tests.tiny import byte_tokenizer, tiny_llama

WIDTHS = (64, 41, 23)
CONFIG = RecoveryConfig(
    tokens=4 * 5 * 24 - 7, batch_size=5, seq_len=24, learning_rate=2e-3, validation_windows=3, micro_batch_size=2
)
"""Five windows a step, two a micro-batch: two processes hold three and two windows (two and one micro-batches, the
second process runs one uncounted padding micro-batch under FSDP); the last step is truncated (7 tokens short)."""


def student(vocab: int, widths: tuple[int, ...] = WIDTHS, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny Llama with layer i's MLP cut to ``widths[i]`` channels (a pruned model of per-layer widths)."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=vocab)
    for index, width in enumerate(widths):
        if width < 64:
            remove_units(model, layer_group(model, "mlp_channel", index), list(range(width)))
    return model.to(dtype)


def train(
    shard: bool = False,
    config: RecoveryConfig = CONFIG,
    checkpoint: Path | None = None,
    stop_at: int | None = None,
    widths: tuple[int, ...] = WIDTHS,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The run (``shard``: FSDP over the process group, decoder layers as units); ``stop_at``: killed after that
    step (KeyboardInterrupt), as a stopped run is; ``widths``, ``dtype``: the student's MLP widths and dtype."""
    tokenizer = byte_tokenizer()
    model = student(len(tokenizer), widths, dtype)
    torch.manual_seed(1)
    teacher = tiny_llama(vocab_size=len(tokenizer)).requires_grad_(False)
    objective = DistillationObjective(teacher, temperature=2.0)

    def progress(step: int, _tokens: int, _result) -> None:
        if step == stop_at:
            raise KeyboardInterrupt

    units = ModelView(model).layer_list if shard else None
    model, report = recover_all_weights(
        model, tokenizer, config, TextSource("alpaca"), objective, checkpoint, progress, units
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, report


def gathered_dtypes() -> dict[str, torch.dtype]:
    """A bfloat16 student sharded with bfloat16 compute: the dtype of a layer's weight as its forward sees it
    (gathered), of the gradient each process keeps (its shard), and of the weight's shard."""
    tokenizer = byte_tokenizer()
    model = student(len(tokenizer), dtype=torch.bfloat16)
    shard_model(model, ModelView(model).layer_list, torch.bfloat16)
    up = model.model.layers[1].mlp.up_proj
    seen: dict[str, torch.dtype] = {}

    def record(module: torch.nn.Module, _args) -> None:
        seen.setdefault("gathered", module.weight.dtype)

    up.register_forward_pre_hook(record)
    model(input_ids=torch.arange(8).view(1, 8), use_cache=False).logits.float().square().mean().backward()
    seen["gradient"] = local(up.weight.grad).dtype
    seen["shard"] = local(up.weight).dtype
    return seen


def worker(rank: int, world: int, init_file: str, out: str, shard: bool, dtype: torch.dtype = torch.float32) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state, report = train(shard, dtype=dtype)
        result: dict = {"state": state, "losses": report["losses"], "validation": report["validation"]}
        if shard and dtype == torch.bfloat16:
            result["dtypes"] = gathered_dtypes()
        elif shard:  # killed after step 3 with a checkpoint every 2 steps, then resumed: the uninterrupted weights?
            folder = Path(out).parent / "checkpoint"
            every_two = replace(CONFIG, checkpoint_every=2)
            uninterrupted, _ = train(True, every_two)
            try:
                train(True, every_two, folder, stop_at=3)
            except KeyboardInterrupt:
                pass
            resumed, resumed_report = train(True, every_two, folder)
            result["resume_equal"] = all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
            result["resumed_from"] = resumed_report["resumed_from_step"]
            try:  # a student of other widths finds the checkpoint: refused on every process, nothing hangs
                train(True, every_two, folder, widths=(64, 23, 41))
                result["refused"] = None
            except SlimkitError as error:
                result["refused"] = str(error)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()
