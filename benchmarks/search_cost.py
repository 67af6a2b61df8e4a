"""The search's cost at a model shape, planned from shapes alone (no weights): candidates per layer, the library's
bytes on disk, the scoring forwards, the stage's memory plan.

    python -m benchmarks.search_cost --shape llama-3.1-8b --dtype-bytes 2 --json out.json
    python -m benchmarks.search_cost --shape smollm2-135m

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from benchmarks.core.arguments import OneLineParser, bench_main, integer
from benchmarks.core.engine_calls import memory_plan
from benchmarks.core.outputs import json_text, write_text
from benchmarks.scale_shapes import REAL

SHAPES = ("llama-3.1-8b", "smollm2-135m")
"""The real shapes (``benchmarks/scale_shapes.py``) the plan is offered for."""


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
    from transformers import AutoModelForCausalLM

    from slimkit.primitives.device.memory_model import ModelShape
    from slimkit.recipes.loading import load_recipe, validate

    config = REAL[shape].config("bfloat16" if dtype_bytes == 2 else "float32")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    rows = layer_library(model, dtype_bytes)
    _, raw = load_recipe("search")
    raw["calibration"].update(samples=samples, seq_len=seq_len, batch_size=batch)
    raw["stages"] = [{"stage": "search", "args": {"holdout": holdout}}]
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    stage_plan = memory_plan(validate(raw, "search"), config, dtype).peak_stage
    memory = {} if stage_plan is None else dict(stage_plan.parts)
    layers = config.num_hidden_layers
    per_layer = len(rows)
    # a candidate of layer l runs layers l..L-1 and the head on the held-out tokens: on average about half a forward
    forwards = per_layer * sum((layers - index) / layers for index in range(layers))
    return {
        "shape": shape,
        "config": {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, bool))},
        "dtype_bytes": dtype_bytes,
        "calibration": {"samples": samples, "seq_len": seq_len, "batch": batch, "holdout_batches": holdout},
        "candidates_per_layer": per_layer,
        "candidates": per_layer * layers,
        "library_bytes_per_layer": sum(r["bytes"] for r in rows),
        "library_bytes": sum(r["bytes"] for r in rows) * layers,
        "model_bytes": ModelShape.from_config(config).total_params() * dtype_bytes,
        "scoring_forwards_of_the_held_out_tokens": round(forwards, 1),
        "statistics_forwards_of_the_calibration": 1,
        "memory_plan_bytes": memory,
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


def main_body(argv: list[str]) -> None:
    parser = OneLineParser("benchmarks.search_cost", __doc__)
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--dtype-bytes", type=int, choices=(2, 4), default=2)
    parser.add_argument("--samples", type=integer(), default=256)
    parser.add_argument("--seq-len", type=integer(), default=128)
    parser.add_argument("--batch", type=integer(), default=8)
    parser.add_argument("--holdout", type=integer(), default=1)
    parser.add_output_file("--json", default=None, help="also write the plan here")
    args = parser.parse(argv)
    result = plan(args.shape, args.dtype_bytes, args.samples, args.seq_len, args.batch, args.holdout)
    print(markdown(result), end="")
    if args.json is not None:
        write_text(args.json, json_text(result), "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
