"""Compare recipes at one target on one model, in one benchmark run.

    python -m benchmarks.compare --ratio 0.2 --name pruning-core \\
        --recipes magnitude random wanda-channels llm-pruner llm-pruner:steps=0

Runs the dense evaluation and then every recipe as its own ``slimkit recipe run`` process (so each row's peak memory
is its own), all with the same target ratio and the same perplexity settings, one after the other on the same
machine. ``NAME:key=value,...`` passes ``--set`` overrides to one recipe (``steps=0`` is shorthand for turning the
LoRA stage off). Writes ``OUT/<date>-<name>.json`` and ``.md`` (``OUT``: benchmarks/results).

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file
from benchmarks.core.outputs import RESULTS, dated_base, json_text, write_text
from benchmarks.core.processes import last_line, log, recipe_run, run_logged
from slimkit.primitives.errors import SlimkitError


def recipe_spec(spec: str, common: list[str]) -> tuple[str, list[str]]:
    """``NAME:key=value,...`` -> ``(NAME, its --set overrides)``, checked by loading the recipe with ``common`` and
    them (``steps=N``: the steps of the recipe's ``lora`` stage)."""
    from slimkit.recipes.loading import load_recipe

    name, _, extra = spec.partition(":")
    overrides = []
    try:
        for item in filter(None, extra.split(",")):
            key, _, value = item.partition("=")
            if key == "steps":  # LoRA steps of the recipe's lora stage
                recipe, _raw = load_recipe(name)
                lora = [i for i, s in enumerate(recipe.stages) if getattr(s, "stage", None) == "lora"]
                if not lora:
                    raise BenchError(f"--recipes {spec}: steps= sets the lora stage's steps; {name} has none")
                overrides.append(f"stages.{lora[0]}.args.steps={value}")
            else:
                overrides.append(f"{key}={value}")
        load_recipe(name, [*common, *overrides])
    except BenchError:
        raise
    except SlimkitError as error:
        raise BenchError(f"--recipes {spec}: {error}") from None
    return name, overrides


def run_slimkit(command: list[str], log_path: Path, what: str) -> None:
    code, _wall = run_logged(command, log_path)
    if code != 0:
        raise BenchError(f"{what} exited with {code}: {last_line(log_path)} (log: {log_path})")


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.compare", __doc__)
    parser.add_argument("--recipes", nargs="+", required=True, help="NAME or NAME:key=value,... (steps=N: LoRA steps)")
    parser.add_argument("--ratio", type=arg.fraction, default=0.2)
    parser.add_argument("--of", default="model", help="what the ratio is of: model, layers, mlp, attention")
    parser.add_argument("--model", type=arg.model_source, default="smollm2-135m")
    parser.add_argument("--ppl", type=arg.names, default=["wikitext2", "ptb"], help="comma-separated datasets")
    parser.add_argument("--seq-len", type=arg.integer(2), default=512)
    parser.add_argument("--max-tokens", type=arg.integer(2), default=16384)
    parser.add_argument("--name", type=arg.file_name, default="compare", help="results are OUT/<date>-<name>.*")
    parser.add_output_folder(
        "--out", "the results", default=RESULTS, help="results folder (default benchmarks/results)"
    )
    parser.add_output_folder("--keep", "the runs", help="keep each run's output folder under this folder")
    return parser


def markdown(settings: dict[str, Any], rows: list[dict[str, Any]], dense_params: str) -> str:
    datasets = settings["ppl"].split(",")
    header = "| recipe | params after | achieved | " + " | ".join(f"{d} ppl" for d in datasets)
    lines = [header + " | compress s | peak MB |", "| --- " * (5 + len(datasets)) + "|"]
    for row in rows:
        ppl = " | ".join(f"{row['metrics'][f'{d}_ppl']:.4g}" for d in datasets)
        if row["params"] is None:
            lines.append(f"| dense | {dense_params} | 0 | {ppl} | - | - |")
            continue
        compress = sum(v for k, v in row["timings_s"]["stages"].items() if k[0].isdigit())
        lines.append(
            f"| {row['recipe']} | {row['params']['after']:,} | {row['achieved']:.2%} | {ppl} | "
            f"{compress:.0f} | {row['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    ppl = ",".join(args.ppl)
    common = [
        f"target.ratio={args.ratio}",
        f"target.of={args.of}",
        f"eval.perplexity.datasets=[{ppl}]",
        f"eval.perplexity.seq_len={args.seq_len}",
        f"eval.perplexity.max_tokens={args.max_tokens}",
    ]
    specs = [(spec, *recipe_spec(spec, [f"model={args.model}", *common])) for spec in args.recipes]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="slimkit-bench-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        dense_json = tmp / "dense.json"
        eval_command = [sys.executable, "-m", "slimkit.cli.main", "eval", args.model, "--ppl", ppl]
        eval_command += [
            "--seq-len",
            str(args.seq_len),
            "--max-tokens",
            str(args.max_tokens),
            "--json",
            str(dense_json),
        ]
        run_slimkit(eval_command, tmp / "dense.log", "slimkit eval")
        dense = read_json_file(dense_json, "the dense evaluation")
        rows.append({"recipe": "dense", "params": None, "metrics": dense["metrics"]})
        for label, name, overrides in specs:
            out = tmp / label.replace(":", "_").replace("=", "-").replace(",", "_")
            log(f"running {label} ...")
            run_slimkit(
                recipe_run(name, out, ["--model", args.model], [*common, *overrides]), Path(f"{out}.log"), label
            )
            report = read_json_file(out / "report.json", f"{label}'s report")
            row = {"recipe": label, "params": report["params"], "achieved": report["target"]["achieved"]}
            keys = ("macs", "metrics", "timings_s", "peak_rss_mb", "stages", "versions")
            rows.append(row | {k: report[k] for k in keys})
    settings = {"model": args.model, "ratio": args.ratio, "of": args.of, "ppl": ppl}
    settings |= {"seq_len": args.seq_len, "max_tokens": args.max_tokens}
    text = markdown(settings, rows, dense_params(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    base = dated_base(args.out, args.name)
    write_text(base.with_suffix(".json"), json_text({"settings": settings, "rows": rows}), "--out")
    write_text(base.with_suffix(".md"), f"Settings: {json.dumps(settings)}\n\n{text}", "--out")
    print(text)


def dense_params(model: str) -> str:
    import slimkit
    from slimkit.primitives.evaluate.counting import count_params

    return f"{count_params(slimkit.load_source(model)[0]):,}"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
