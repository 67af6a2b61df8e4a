"""The recovery curve: ``quality`` at a ratio (default 20%), then distillation from the dense model at several token
budgets; a table and a plot of the WikiText-2 perplexity ratio to dense against the tokens trained.

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file, read_yaml_file
from benchmarks.core.outputs import json_text, write_text
from benchmarks.core.processes import OFFLINE_ENV, recipe_run

REPO = Path(__file__).resolve().parent.parent
GOAL = 1.3
"""The issue's goal: at most this WikiText-2 perplexity ratio to dense after recovery."""


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.recovery_curve", __doc__)
    parser.add_argument("--model", type=arg.model_source, default="smollm2-135m", help="a bundled name or a folder")
    parser.add_argument("--ratio", type=arg.fraction, default=0.2, help="quality's target ratio of the model")
    parser.add_argument(
        "--tokens", type=arg.integers(1), default=[100000, 500000, 2000000], help="comma-separated distillation budgets"
    )
    parser.add_argument("--device", type=arg.device, default="cpu")
    parser.add_argument("--dtype", type=arg.dtype, default=None, help="model dtype (default: the recipe's)")
    parser.add_argument("--dataset", type=arg.corpus, default="c4", help="distillation text: a shipped corpus")
    parser.add_argument("--data-folder", type=arg.input_folder, default=None, help="a local text folder instead")
    parser.add_argument("--batch-size", type=arg.integer(1), default=8)
    parser.add_argument("--micro-batch-size", type=arg.integer(1), default=None)
    parser.add_argument("--seq-len", type=arg.integer(2), default=256)
    parser.add_argument("--learning-rate", type=arg.positive, default=1e-4)
    parser.add_argument("--schedule", default="cosine", choices=["constant", "cosine"])
    parser.add_argument("--warmup-steps", type=arg.integer(0), default=10)
    parser.add_argument("--rank", type=arg.integer(1), default=8, help="LoRA rank of the distillation adapters")
    parser.add_argument("--validation-windows", type=arg.integer(0), default=16)
    parser.add_argument("--calibration-samples", type=arg.integer(1), default=None, help="quality's (default: its own)")
    parser.add_argument("--eval-tokens", type=arg.integer(2), default=None, help="perplexity tokens (default: its own)")
    parser.add_argument("--seed", type=arg.integer(0), default=0)
    parser.add_output_folder("--out", "the runs and the results", required=True, help="folder of the runs and results")
    return parser


def slimkit_run(recipe: str, out: Path, args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """``slimkit recipe run`` in its own process (skipped when ``out/report.json`` exists); the report as a dict."""
    report = out / "report.json"
    if not report.is_file():
        flags = ["--device", args.device] + (["--dtype", args.dtype] if args.dtype else [])
        command = recipe_run(recipe, out, flags, overrides)
        print(" ".join(command), flush=True)
        done = subprocess.run(command, cwd=REPO.parent, env={**os.environ, **OFFLINE_ENV})
        if done.returncode != 0:
            raise BenchError(f"{' '.join(command)} exited with {done.returncode}")
    return read_json_file(report, "a run report")


def eval_overrides(args: argparse.Namespace) -> list[str]:
    return [f"eval.perplexity.max_tokens={args.eval_tokens}"] if args.eval_tokens else []


def distill_recipe(args: argparse.Namespace, pruned: Path, tokens: int, quality: dict[str, Any]) -> dict[str, Any]:
    """One distillation row: the pruned folder, no removal, one ``distill`` stage of ``tokens``."""
    distill = {
        "tokens": tokens,
        "rank": args.rank,
        "alpha": 2.0 * args.rank,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "learning_rate": args.learning_rate,
        "schedule": args.schedule,
        "warmup_steps": args.warmup_steps,
        "validation_windows": args.validation_windows,
        "validate_every": max(1, tokens // (args.batch_size * args.seq_len) // 10),
        "checkpoint_every": max(1, tokens // (args.batch_size * args.seq_len) // 5),
        "dataset": args.dataset,
    }
    if args.data_folder:
        distill["data_folder"] = args.data_folder
    if args.micro_batch_size:
        distill["micro_batch_size"] = args.micro_batch_size
    return {
        "name": f"quality-distill-{tokens}",
        "model": str(pruned),
        "seed": args.seed,
        "target": {"ratio": 0},
        "stages": [{"stage": "distill", "args": distill}],
        "eval": quality["eval"],
    }


def wikitext_ratio(report: dict[str, Any]) -> tuple[float | None, float | None]:
    """(WikiText-2 perplexity, its ratio to the dense model's) from a report."""
    ppl = report.get("metrics", {}).get("wikitext2_ppl")
    dense = (report.get("dense") or {}).get("metrics", {}).get("wikitext2_ppl")
    return ppl, (ppl / dense if ppl and dense else None)


def row(tokens: int, report: dict[str, Any]) -> dict[str, Any]:
    ppl, ratio = wikitext_ratio(report)
    details = report.get("stages", {}).get("distill", {}) if tokens else {}
    return {
        "tokens": tokens,
        "trained_tokens": details.get("tokens", 0),
        "wikitext2_ppl": ppl,
        "wikitext2_x_dense": ratio,
        "ptb_ppl": report.get("metrics", {}).get("ptb_ppl"),
        "validation_kl_last": details.get("validation_last"),
        "train_seconds": details.get("train_seconds"),
        "tokens_per_second": details.get("tokens_per_second"),
        "stopped": details.get("stopped"),
        "device": report.get("placement", {}).get("device"),
    }


def write_results(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_text(args.out / "curve.json", json_text({"settings": settings, "rows": rows}), "--out")
    lines = [
        f"# Recovery curve: quality at {args.ratio:.0%} on {args.model}, distillation on {args.dataset}",
        "",
        f"Settings: {json.dumps(settings)}",
        "",
        "| tokens | trained | WikiText-2 | x dense | PTB | tokens/s | train s | stopped |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        cells = [
            f"{r['tokens']:,}",
            f"{r['trained_tokens']:,}",
            _number(r["wikitext2_ppl"]),
            _number(r["wikitext2_x_dense"], 3),
            _number(r["ptb_ppl"]),
            _number(r["tokens_per_second"], 0),
            _number(r["train_seconds"], 0),
            r["stopped"] or "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    best = min((r["wikitext2_x_dense"] for r in rows if r["wikitext2_x_dense"]), default=None)
    if best is not None:
        verdict = "met" if best <= GOAL else f"missed by {best - GOAL:.2f}x"
        lines += ["", f"Goal: at most {GOAL}x dense WikiText-2 perplexity: {verdict} (best {best:.3f}x)."]
    write_text(args.out / "curve.md", "\n".join(lines) + "\n", "--out")
    points = [(max(r["tokens"], 1), r["wikitext2_x_dense"]) for r in rows if r["wikitext2_x_dense"]]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p[0] for p in points], [p[1] for p in points], "o-", label="quality + distillation")
    axis.axhline(GOAL, color="gray", linestyle="--", label=f"goal {GOAL}x")
    axis.set_xscale("log")
    axis.set_xlabel("distillation tokens (0 plotted at 1)")
    axis.set_ylabel("WikiText-2 perplexity / dense")
    axis.set_title(f"{args.model}: quality at {args.ratio:.0%}, recovered")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "curve.png", dpi=120)
    plt.close(figure)
    print("\n".join(lines))


def _number(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def main_body(argv: list[str]) -> None:
    from slimkit.recipes.loading import load_recipe

    args = build_parser().parse(argv)
    overrides = [f"model.source={args.model}", f"target.ratio={args.ratio}", f"seed={args.seed}"]
    if args.calibration_samples:
        overrides.append(f"calibration.samples={args.calibration_samples}")
    load_recipe("quality", overrides + eval_overrides(args))  # a setting the recipe refuses: one line, before any run
    args.out.mkdir(parents=True, exist_ok=True)
    quality = slimkit_run("quality", args.out / "quality", args, overrides + eval_overrides(args))
    quality_recipe = read_yaml_file(args.out / "quality" / "model" / "recipe.yaml", "quality's saved recipe")
    rows = [row(0, quality)]
    for tokens in args.tokens:
        recipe = distill_recipe(args, args.out / "quality" / "model", tokens, quality_recipe)
        path = args.out / f"distill-{tokens}.yaml"
        write_text(path, yaml.safe_dump(recipe, sort_keys=False), "--out")
        rows.append(row(tokens, slimkit_run(str(path), args.out / f"distill-{tokens}", args, eval_overrides(args))))
    write_results(rows, args)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
