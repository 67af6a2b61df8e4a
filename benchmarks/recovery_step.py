"""Recovery steps at a model's shape: distillation (LoRA, or every weight with ``--adapter none``, sharded over the
processes of ``torchrun`` with ``--sharding fsdp``) of a random-weight student from a random-weight teacher of
Llama-3.1-8B's shape (or a tiny one on CPU) through the token-budgeted loop; measured peak memory and tokens/s beside
the memory plan's estimate for the same settings (and for ``--plan-processes`` other process counts).

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.engine_calls import join_processes, memory_plan
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import emit_json

SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


class CodeTokenizer:
    """Token ids from character codes (modulo the vocabulary), end-of-text id 0: real text, no tokenizer files."""

    eos_token_id = 0

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(c) % (self.vocab - 1) for c in text]}


def build(shape: dict[str, Any], mlp: float, device: str, dtype: torch.dtype, seed: int) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the dtype: no float32 copy of 8B on the device
    try:
        with torch.device(device):
            teacher = LlamaForCausalLM(LlamaConfig(**shape)).eval()
            narrow = {**shape, "intermediate_size": int(shape["intermediate_size"] * mlp)}
            student = LlamaForCausalLM(LlamaConfig(**narrow)).eval()
    finally:
        torch.set_default_dtype(default)
    return teacher, student


def distill_recipe(args: argparse.Namespace) -> Any:
    """The one-stage distillation recipe of these settings (validated: a bad setting is one line)."""
    from pydantic import ValidationError

    from slimkit.primitives.errors import format_validation_error
    from slimkit.recipes.schema import Recipe

    distill: dict[str, Any] = {"tokens": 1, "batch_size": args.batch_size, "seq_len": args.seq_len}
    if args.adapter == "lora":
        distill["rank"] = args.rank
    else:
        distill.update(adapter="none", sharding=args.sharding)
    if args.micro_batch_size:
        distill["micro_batch_size"] = args.micro_batch_size
    raw = {"name": "recovery-step", "model": "unused", "target": {"ratio": 0}, "eval": {"perplexity": None}}
    try:
        return Recipe.model_validate(raw | {"stages": [{"stage": "distill", "args": distill}]})
    except ValidationError as error:
        raise BenchError(format_validation_error(error)) from None


def planned_bytes(
    shape: dict[str, Any], args: argparse.Namespace, dtype: torch.dtype, processes: int
) -> dict[str, float]:
    """The memory plan's parts (GiB) per device of this distillation on the teacher's shape, for ``processes``
    launched processes (distill's plan reads the launched world: the student's training state divided among them
    under ``--sharding fsdp``); ``released``: the weights the training state replaces; ``total``: the plan's peak."""
    from transformers import LlamaConfig

    plan = memory_plan(distill_recipe(args), LlamaConfig(**shape), dtype, processes=processes)
    stage = plan.stages[0]
    parts = {"weights": plan.weights, **stage.parts}
    gib = {name: value / 2**30 for name, value in parts.items()}
    return gib | {"released": stage.released / 2**30, "total": plan.peak / 2**30}


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.recovery_step", __doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--student-mlp", type=arg.share, default=0.8, help="the student's MLP width / the teacher's, in (0, 1]"
    )
    parser.add_argument("--device", type=arg.device, default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=arg.integer(1), default=4)
    parser.add_argument("--micro-batch-size", type=arg.integer(1), default=None)
    parser.add_argument("--seq-len", type=arg.integer(2), default=128)
    parser.add_argument("--rank", type=arg.integer(1), default=8)
    parser.add_argument("--adapter", choices=["lora", "none"], default="lora", help="none: every weight trains")
    parser.add_argument("--sharding", choices=["none", "fsdp"], default="none", help="fsdp: under torchrun, N > 1")
    parser.add_argument(
        "--plan-processes", type=arg.integers(1), default=[], help="also the plan for these process counts, e.g. 8,16"
    )
    parser.add_argument("--steps", type=arg.integer(1), default=3, help="steps run (the first is not timed)")
    parser.add_output_file("--out", help="write the result as JSON here")
    return parser


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    if args.sharding == "fsdp" and args.adapter != "none":
        raise BenchError("--sharding fsdp trains every weight: give --adapter none")

    from slimkit.primitives.arch.view import ModelView
    from slimkit.primitives.finetune import LoraConfig
    from slimkit.primitives.finetune.full_recovery import recover_all_weights
    from slimkit.primitives.finetune.lora import LLAMA_TARGETS
    from slimkit.primitives.finetune.recovery import DistillationObjective, RecoveryConfig
    from slimkit.primitives.finetune.token_recovery import recover_in_tokens
    from slimkit.primitives.finetune.token_stream import TextSource

    processes = join_processes()  # torchrun's processes (one outside a launcher)
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    planned = planned_bytes(shape, args, dtype, processes.world)  # a setting the recipe refuses: before any work
    planned_for = {str(n): planned_bytes(shape, args, dtype, n) for n in args.plan_processes}
    if processes.world > 1 and args.device.startswith("cuda"):
        args.device = f"cuda:{torch.cuda.current_device()}"
    teacher, student = build(shape, args.student_mlp, args.device, dtype, 0)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_tokens = args.batch_size * args.seq_len
    config = RecoveryConfig(
        tokens=args.steps * step_tokens,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        validation_windows=0,
        learning_rate=1e-4,
    )
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules=LLAMA_TARGETS)
    times: list[float] = []
    last = [time.perf_counter()]

    def progress(_step: Any, _tokens: Any, _result: Any) -> None:
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    objective = DistillationObjective(teacher)
    source = TextSource("c4", seed=0)
    tokenizer = CodeTokenizer(shape["vocab_size"])
    if args.adapter == "none":
        units = list(ModelView(student).layer_list) if args.sharding == "fsdp" else None
        _model, report = recover_all_weights(student, tokenizer, config, source, objective, None, progress, units)
    else:
        _model, report = recover_in_tokens(
            student, tokenizer, lora, config, source, objective, None, progress, "distill"
        )
    timed = times[1:] or times
    result = {
        "shape": args.shape,
        "student_mlp": args.student_mlp,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "adapter": args.adapter,
        "lora_rank": args.rank if args.adapter == "lora" else None,
        "sharding": args.sharding,
        "processes": processes.world,
        "steps": report["steps"],
        "tokens_per_second": step_tokens * len(timed) / sum(timed),  # global batch tokens: all processes
        "step_seconds": timed,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "planned_gib": planned,
        "planned_gib_for": planned_for,
        "losses": report["losses"],
    }
    if processes.main:
        emit_json(result, args.out, "--out")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
