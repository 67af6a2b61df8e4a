"""The search's cost at a model shape, planned from shapes alone (no weights): candidates per layer, the library's
bytes on disk, the scoring forwards, the stage's memory plan.

    python -m benchmarks.search_cost --shape llama-3.1-8b --dtype-bytes 2 --json out.json
    python -m benchmarks.search_cost --shape smollm2-135m

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
}
"""Llama-shaped configs by name (smollm2-135m's is its own config's)."""


def layer_library(model: torch.nn.Module, dtype_bytes: int) -> list[dict[str, Any]]:
    """Layer 0's candidates of the default ladder: name and bytes of the sub-block's tensors (on the meta device)."""
    from slimkit.primitives.arch import ModelView
    from slimkit.primitives.search.build import BuildSettings, part_state, reshape, timing_structure
    from slimkit.primitives.search.candidates import CandidateLadder, layer_specs

    rows = []
    for spec in layer_specs(model, 0, CandidateLadder(), {}):
        if spec.kind == "dense":
            continue
        probe = copy.deepcopy(model)
        reshape(probe, 0, spec, timing_structure(probe, 0, spec, BuildSettings()))
        state = part_state(ModelView(probe).layer(0), spec.part)
        rows.append(
            {"candidate": f"{spec.part}/{spec.name}", "bytes": sum(t.numel() for t in state.values()) * dtype_bytes}
        )
    return rows


def plan(shape: str, dtype_bytes: int, samples: int, seq_len: int, batch: int, holdout: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimkit.engine.stage_memory import MemoryInputs
    from slimkit.primitives.device.memory_model import ModelShape
    from slimkit.recipes.schema import CalibrationConfig
    from slimkit.stages.search_args import SearchArgs

    config = LlamaConfig(**SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    rows = layer_library(model, dtype_bytes)
    layers = config.num_hidden_layers
    calibration = CalibrationConfig(samples=samples, seq_len=seq_len, batch_size=batch)
    inputs = MemoryInputs(ModelShape.from_config(config), calibration, dtype_bytes)
    memory = SearchArgs(holdout=holdout).memory("search", inputs)
    per_layer = len(rows)
    # a candidate of layer l runs layers l..L-1 and the head on the held-out tokens: on average about half a forward
    forwards = per_layer * sum((layers - index) / layers for index in range(layers))
    return {
        "shape": shape,
        "config": SHAPES[shape],
        "dtype_bytes": dtype_bytes,
        "calibration": {"samples": samples, "seq_len": seq_len, "batch": batch, "holdout_batches": holdout},
        "candidates_per_layer": per_layer,
        "candidates": per_layer * layers,
        "library_bytes_per_layer": sum(r["bytes"] for r in rows),
        "library_bytes": sum(r["bytes"] for r in rows) * layers,
        "model_bytes": ModelShape.from_config(config).total_params() * dtype_bytes,
        "scoring_forwards_of_the_held_out_tokens": round(forwards, 1),
        "statistics_forwards_of_the_calibration": 1,
        "memory_plan_bytes": dict(memory.parts),
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"search cost at {result['shape']} ({result['dtype_bytes']} bytes a weight), planned from shapes:",
        "",
        f"- candidates: {result['candidates_per_layer']} per layer, {result['candidates']} in all",
        f"- library on disk: {result['library_bytes_per_layer'] / gib:.2f} GiB a layer, "
        f"{result['library_bytes'] / gib:.1f} GiB in all (the model: {result['model_bytes'] / gib:.1f} GiB)",
        f"- scoring: {result['scoring_forwards_of_the_held_out_tokens']} forwards of the held-out tokens; building: "
        "one layer-by-layer pass over the calibration",
        "- memory beside the weights: "
        + ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in result["memory_plan_bytes"].items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.inputs import OneLineParser, check_file_option

    parser = OneLineParser(prog="python -m benchmarks.search_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--holdout", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the plan here")
    args = parser.parse_args(argv)
    if args.json is not None:
        check_file_option("--json", args.json)
    result = plan(args.shape, args.dtype_bytes, args.samples, args.seq_len, args.batch, args.holdout)
    print(markdown(result), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
