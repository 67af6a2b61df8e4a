"""Each stage's memory above the weights, counted exactly, against its memory plan, on a random model of a chosen shape.

    python -m benchmarks.stage_memory sp3-oneshot cce llm-pruner-channel          # Llama-3 proportions, scaled down
    python -m benchmarks.stage_memory deploy --hidden 1024 --intermediate 3584 --layers 8 --json out.json

A random Llama of the given widths (default: hidden 512, 8 layers, Llama-3's MLP ratio and grouped keys, a
49,152-token vocabulary: the embedding and head hold most of the weights, as the untied head of Llama-3.1-8B
weighs most in its rewrites) is built in bfloat16 on the CPU with smollm2-135m's tokenizer; each recipe runs on it
in memory (calibration 8 x 128 tokens, recovery stages and evaluation dropped), its stages wrapped so that the live
tensor bytes (``primitives/evaluate/tensor_bytes.py``: every storage a torch operation creates, exact on any
device, blind to allocator caching) are read when each stage starts and at its peak. A row: the stage's peak above
what was live when it started (the largest over its calls: a layer stage runs once per layer), and the plan's part
for that stage (``PlansMemory.memory``; a layer-wise block's plan stands for each of its stages). Cost only, no quality.
Method note: docs/methods/devices-offload.md.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.engine_calls import memory_plan, wrapped_stages
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import emit_json
from benchmarks.core.recipes import RECOVERY_STAGES

MIB = 2**20
VOCAB = 49152
"""smollm2-135m's tokenizer's vocabulary: the model's, so that every calibration token has an embedding."""


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.stage_memory", __doc__)
    parser.add_argument("recipes", nargs="+", type=arg.recipe, help="bundled recipe names")
    for option, default in (("--hidden", 512), ("--intermediate", 1792), ("--layers", 8), ("--heads", 8)):
        parser.add_argument(option, type=arg.integer(1), default=default)
    parser.add_argument("--kv-heads", type=arg.integer(1), default=2)
    parser.add_argument(
        "--samples", type=arg.integer(1), default=8, help="calibration samples of 128 tokens, one batch"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for every recipe"
    )
    parser.add_output_file("--json", help="also write the rows here")
    return parser


def build_model(args: argparse.Namespace, folder: Path) -> None:
    """The random bfloat16 Llama of ``args``' widths, saved in ``folder`` with smollm2-135m's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from slimkit.primitives.io.model_sources import resolve_source

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).bfloat16().save_pretrained(folder)
    tokenizer_folder, _info = resolve_source("smollm2-135m")
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)


def measure(recipe_name: str, folder: Path, samples: int, overrides: list[str]) -> list[dict[str, Any]]:
    """Each stage of ``recipe_name`` run on the model in ``folder``: its live peak above its start, and its plan."""
    import torch

    import slimkit
    from slimkit.primitives.evaluate.tensor_bytes import LiveTensorBytes
    from slimkit.recipes.loading import load_recipe, validate

    _recipe, raw = load_recipe(recipe_name, overrides)
    raw = {**raw, "model": {"dtype": "bfloat16", "device": "cpu"}, "eval": {"perplexity": None}}
    raw["calibration"] = {**(raw.get("calibration") or {}), "samples": samples, "seq_len": 128, "batch_size": samples}
    raw["stages"] = [s for s in raw["stages"] if not (isinstance(s, dict) and s.get("stage") in RECOVERY_STAGES)]
    raw["target"] = {**raw["target"], "strict": False}  # a small shape's coarse widths may miss it: cost only
    model, tokenizer, _info = slimkit.load_source(str(folder), device="cpu", dtype="bfloat16")
    plan = memory_plan(validate(raw, recipe_name), model.config, torch.bfloat16, torch.device("cpu"))
    planned = {memory.stage: memory for memory in plan.stages}
    for memory in plan.stages:  # a layer-wise block's plan stands for each of its stages
        if memory.stage.startswith("sequential["):
            planned.update({name: memory for name in memory.stage.removeprefix("sequential[")[:-1].split(",")})
    rows: list[dict[str, Any]] = []
    live = LiveTensorBytes()

    def wrapped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = live.now
            live.peak = live.now  # the peak from here on
            out = fn(*args, **kwargs)
            measured = round((live.peak - start) / MIB, 1)
            row = next((r for r in rows if r["stage"] == name), None)  # a layer stage runs once per layer
            if row is not None:
                row["measured_mib"], row["calls"] = max(row["measured_mib"], measured), row["calls"] + 1
                return out
            memory = planned.get(name)
            rows.append(
                {
                    "recipe": recipe_name,
                    "stage": name,
                    "calls": 1,
                    "measured_mib": measured,
                    "planned_mib": round(memory.net / MIB, 1) if memory is not None else None,
                    "planned_parts_mib": {k: round(v / MIB, 1) for k, v in memory.parts.items()} if memory else None,
                }
            )
            return out

        return run

    with wrapped_stages(wrapped), live:
        slimkit.run(raw, None, model=model, tokenizer=tokenizer, evaluate=False, compare_dense=False)
    return rows


def main_body(argv: list[str]) -> None:
    from slimkit.recipes.loading import load_recipe

    args = build_parser().parse(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise BenchError("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    for name in args.recipes:  # a bad override is one line before any model is built
        load_recipe(name, args.set)
    with tempfile.TemporaryDirectory(prefix="slimkit-stage-memory-") as scratch:
        build_model(args, Path(scratch))
        rows = [row for name in args.recipes for row in measure(name, Path(scratch), args.samples, args.set)]
    shape = {key: getattr(args, key) for key in ("hidden", "intermediate", "layers", "heads", "kv_heads")}
    shape["vocab"] = VOCAB
    result = {"shape": shape, "dtype": "bfloat16", "calibration_tokens": args.samples * 128, "overrides": args.set}
    result["rows"] = rows
    emit_json(result, args.json, "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
