"""Cost of expert pruning (moe-expert-prune's work) at the shapes of Qwen3-30B-A3B and Mixtral-8x7B, layer by layer.

    python -m benchmarks.moe_scale --device cuda                       # both real shapes, bf16, on the GPU
    python -m benchmarks.moe_scale --quick                             # a tiny shape on the CPU (the smoke test)

No MoE weights exist on this machine, so each row builds ONE decoder layer of the shape with random weights: the
model (one layer, the real widths, expert count, top-k and vocabulary) is created on the meta device and
materialised directly on ``--device`` in ``--dtype``, never at full size on the CPU. On that layer it times what
``prune_experts`` does per layer: the calibration forward with the routing hooks
(:func:`slimkit.primitives.calibration.routing.collect_routing`, ``samples x seq_len`` random tokens), NAEE's kept-set
search on ``tokens`` sampled router inputs (exhaustive or greedy as the stage decides), and the surgery; and the peak
device memory beside the layer's weights. The whole run is then projected as ``layers x`` the per-layer time, and
its memory as the whole model's weights plus the per-layer peak (the stage keeps the whole model on the device).
Random weights: cost only, never quality. Method note: docs/methods/moe-experts.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import RESULTS, write_results
from benchmarks.core.processes import log
from benchmarks.core.random_models import random_model

STATEMENT = "Random weights: cost (time, memory) only; the quality of expert pruning is not measured here."


@dataclass(frozen=True)
class MoEShape:
    """A MoE decoder's shape (the Hugging Face config values)."""

    name: str
    family: str
    hidden: int
    expert_width: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    source: str = ""

    def config(self, layers: int = 1) -> Any:
        from transformers import AutoConfig

        values: dict[str, Any] = {
            "hidden_size": self.hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "num_experts_per_tok": self.top_k,
            "max_position_embeddings": 4096,
        }
        if self.family == "mixtral":
            values |= {"intermediate_size": self.expert_width, "num_local_experts": self.experts}
        else:
            values |= {
                "moe_intermediate_size": self.expert_width,
                "intermediate_size": self.expert_width,
                "num_experts": self.experts,
                "norm_topk_prob": True,
            }
        return AutoConfig.for_model(self.family, **values)

    def params(self) -> dict[str, int]:
        """Parameters of one layer's experts (with the router) and of the whole model."""
        from slimkit.primitives.device.memory_model import ModelShape

        shape = ModelShape.from_config(self.config(self.layers))
        return {"layer_moe": shape.mlp_params(), "layer": shape.layer_params(), "model": shape.total_params()}


# Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 config.json values.
SHAPES = {
    "qwen3-30b-a3b": MoEShape(
        "qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, 48, 32, 4, 128, 151936, "Qwen/Qwen3-30B-A3B"
    ),
    "mixtral-8x7b": MoEShape(
        "mixtral-8x7b", "mixtral", 4096, 14336, 8, 2, 32, 32, 8, 128, 32000, "mistralai/Mixtral-8x7B-v0.1"
    ),
}
QUICK = MoEShape("tiny-moe", "qwen3_moe", 64, 32, 16, 4, 4, 4, 2, 16, 512, "tiny")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_layer(shape: MoEShape, device: str, dtype: str) -> Any:
    """A one-layer model of ``shape`` with random weights, made on the meta device and materialised on ``device``."""
    return random_model(shape.config(1), dtype, device).eval()


def measure(shape: MoEShape, args: argparse.Namespace) -> dict[str, Any]:
    """One row: the per-layer cost of prune_experts on ``shape`` and its projection to the whole model."""
    import torch

    from slimkit.primitives.arch.moe import moe_blocks
    from slimkit.primitives.calibration.routing import collect_routing
    from slimkit.primitives.experts.routed import ExpertWeights
    from slimkit.primitives.experts.scores import naee_search
    from slimkit.primitives.experts.surgery import keep_experts

    device = torch.device(args.device)
    build_start = time.perf_counter()
    model = build_layer(shape, args.device, args.dtype)
    _sync(device)
    build_s = time.perf_counter() - build_start
    base = model.model  # no head: the stage's pass needs the routing, not the logits
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, shape.vocab, (args.batch_size, args.seq_len), generator=generator)
        for _ in range(math.ceil(args.samples / args.batch_size))
    ]
    keep = shape.experts - round(args.ratio * shape.experts)
    timings: dict[str, float] = {}
    with torch.no_grad():
        start = time.perf_counter()
        stats = collect_routing(base, batches, keep_inputs=args.tokens, stats_device="cpu")
        _sync(device)
        timings["routing_pass_s"] = time.perf_counter() - start
        block = moe_blocks(base)[0]
        sampled = stats[0].inputs
        assert sampled is not None  # kept: keep_inputs above
        x = sampled.to(device, block.router.weight.dtype)
        start = time.perf_counter()
        found = naee_search(ExpertWeights.of(block), x, keep, max_candidates=args.max_candidates)
        _sync(device)
        timings["naee_search_s"] = time.perf_counter() - start
        start = time.perf_counter()
        keep_experts(block, found.kept)
        _sync(device)
        timings["surgery_s"] = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    per_layer = sum(timings.values())
    params = shape.params()
    bytes_per = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    row: dict[str, Any] = {
        "shape": asdict(shape),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "keep": keep,
        "candidates": found.candidates,
        "exhaustive": found.exhaustive,
        "calibration_tokens": args.samples * args.seq_len,
        "search_tokens": int(x.shape[0]),
        "build_s": round(build_s, 3),
        **{k: round(v, 4) for k, v in timings.items()},
        "per_layer_s": round(per_layer, 4),
        "projected_run_s": round(per_layer * shape.layers, 2),
        "layer_weights_gib": round(weights / 2**30, 3) if weights else None,
        "peak_beside_layer_gib": round((peak - weights) / 2**30, 3) if peak is not None else None,
        "model_weights_gib": round(params["model"] * bytes_per / 2**30, 2),
        "params": params,
    }
    if peak is not None:
        row["projected_peak_gib"] = round(row["model_weights_gib"] + row["peak_beside_layer_gib"], 2)
    del model, base, block, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"# moe-expert-prune cost at real MoE shapes ({result['date']})",
        "",
        STATEMENT,
        "",
        f"Command: `{result['command']}`. Device {s['device']}, {s['dtype']}; calibration {s['samples']} x "
        f"{s['seq_len']} random tokens; NAEE on {s['tokens']} sampled router inputs per layer; {s['ratio']:.0%} of "
        "each layer's experts removed (uniform).",
        "",
        "| shape | experts (top-k) | kept | NAEE candidates | routing pass s | search s | per layer s | "
        "projected run s | layer weights GiB | peak beside layer GiB | model weights GiB | projected peak GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        shape = row["shape"]
        lines.append(
            f"| {shape['name']} | {shape['experts']} ({shape['top_k']}) | {row['keep']} | {row['candidates']}"
            f"{' (all)' if row['exhaustive'] else ' (greedy)'} | {row['routing_pass_s']} | {row['naee_search_s']} | "
            f"{row['per_layer_s']} | {row['projected_run_s']} | {row['layer_weights_gib'] or '-'} | "
            f"{row['peak_beside_layer_gib'] if row['peak_beside_layer_gib'] is not None else '-'} | "
            f"{row['model_weights_gib']} | {row.get('projected_peak_gib', '-')} |"
        )
    lines += [
        "",
        "Projected run: layers x the measured per-layer time (the stage's routing pass runs every layer once; its "
        "search and surgery are per layer). Projected peak: the whole model's weights (the stage holds them on the "
        "device) plus the measured peak beside one layer.",
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.moe_scale", __doc__)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--quick", action="store_true", help="a tiny shape on the CPU only (the smoke test)")
    parser.add_argument("--device", type=arg.device, default="cpu")
    parser.add_argument("--dtype", type=arg.dtype, default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--samples", type=arg.integer(1), default=32)
    parser.add_argument("--seq-len", type=arg.integer(1), default=512)
    parser.add_argument("--batch-size", type=arg.integer(1), default=4)
    parser.add_argument("--tokens", type=arg.integer(1), default=1024, help="router inputs per layer for NAEE's search")
    parser.add_argument("--ratio", type=arg.fraction, default=0.25, help="share of each layer's experts removed")
    parser.add_argument("--max-candidates", type=arg.integer(1), default=5000)
    parser.add_output_base("--out", help="results base path (default benchmarks/results/DATE-moe-scale)")
    return parser


def settings_of(argv: list[str]) -> tuple[argparse.Namespace, list[MoEShape]]:
    """The parsed arguments (``--quick``'s budgets applied) and the shapes, every one checked before any work."""
    args = build_parser().parse(argv)
    if args.quick:
        args.samples, args.seq_len, args.batch_size, args.tokens = 4, 32, 2, 64
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    shapes = [QUICK] if args.quick else [SHAPES[name] for name in args.shapes]
    for shape in shapes:
        keep = shape.experts - round(args.ratio * shape.experts)
        if keep < shape.top_k:
            raise BenchError(
                f"--ratio {args.ratio:g} leaves {keep} of {shape.name}'s {shape.experts} experts, fewer than the "
                f"{shape.top_k} its router picks per token; give at most {1 - shape.top_k / shape.experts:g}"
            )
    return args, shapes


def run(args: argparse.Namespace, shapes: list[MoEShape], argv: list[str]) -> dict[str, Any]:
    rows = []
    for shape in shapes:
        log(f"moe_scale: {shape.name} on {args.device} ...")
        rows.append(measure(shape, args))
    settings = {k: getattr(args, k) for k in ("device", "dtype", "samples", "seq_len", "tokens", "ratio")}
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.moe_scale " + " ".join(argv),
        "statement": STATEMENT,
        "settings": settings,
        "rows": rows,
    }


def main_body(argv: list[str]) -> None:
    args, shapes = settings_of(argv)
    result = run(args, shapes, argv)
    base = args.out or RESULTS / f"{result['date']}-moe-scale{'-quick' if args.quick else ''}"
    base.parent.mkdir(parents=True, exist_ok=True)
    write_results(base, result, markdown(result))
    print(markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
