"""Compare recipes at one target on one model, in one benchmark run.

    python -m benchmarks.compare --ratio 0.2 --name pruning-core \\
        --recipes magnitude random wanda-channels llm-pruner llm-pruner:steps=0

Runs the dense evaluation and then every recipe as its own ``slimkit recipe run`` process (so each
row's peak memory is its own), all with the same target ratio and the same perplexity settings,
one after the other on the same machine. ``NAME:key=value,...`` passes ``--set`` overrides to one
recipe (``steps=0`` is shorthand for turning the LoRA stage off). Writes
``benchmarks/results/<date>-<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _slimkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "slimkit.cli.main", *args], check=True, stdout=subprocess.DEVNULL)


def _recipe_overrides(spec: str) -> tuple[str, str, list[str]]:
    from slimkit.recipes.loading import load_recipe

    name, _, extra = spec.partition(":")
    overrides = []
    for item in filter(None, extra.split(",")):
        key, _, value = item.partition("=")
        if key == "steps":  # LoRA steps of the recipe's lora stage
            recipe, _raw = load_recipe(name)
            index = next(i for i, s in enumerate(recipe.stages) if getattr(s, "stage", None) == "lora")
            overrides.append(f"stages.{index}.args.steps={value}")
        else:
            overrides.append(f"{key}={value}")
    return spec, name, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", required=True)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--of", default="model")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ppl", default="wikitext2,ptb")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--name", default="compare")
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's output folder under this folder")
    args = parser.parse_args()

    datasets = args.ppl.split(",")
    common = [
        f"target.ratio={args.ratio}",
        f"target.of={args.of}",
        f"eval.perplexity.datasets=[{args.ppl}]",
        f"eval.perplexity.seq_len={args.seq_len}",
        f"eval.perplexity.max_tokens={args.max_tokens}",
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="slimkit-bench-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        dense_json = Path(tmp) / "dense.json"
        _slimkit(
            "eval",
            args.model,
            "--ppl",
            args.ppl,
            "--seq-len",
            str(args.seq_len),
            "--max-tokens",
            str(args.max_tokens),
            "--json",
            str(dense_json),
        )
        dense = json.loads(dense_json.read_text())
        rows.append({"recipe": "dense", "params": None, "metrics": dense["metrics"]})
        for spec in args.recipes:
            label, name, overrides = _recipe_overrides(spec)
            out = Path(tmp) / label.replace(":", "_").replace("=", "-").replace(",", "_")
            sets = [x for o in [*common, *overrides] for x in ("--set", o)]
            print(f"running {label} ...", file=sys.stderr, flush=True)
            _slimkit("recipe", "run", name, "--out", str(out), "--model", args.model, *sets)
            report = json.loads((out / "report.json").read_text())
            rows.append(
                {
                    "recipe": label,
                    "params": report["params"],
                    "achieved": report["target"]["achieved"],
                    "macs": report["macs"],
                    "metrics": report["metrics"],
                    "timings_s": report["timings_s"],
                    "peak_rss_mb": report["peak_rss_mb"],
                    "stages": report["stages"],
                    "versions": report["versions"],
                }
            )
    settings = {k: getattr(args, k) for k in ("model", "ratio", "of", "ppl", "seq_len", "max_tokens")}
    stamp = dt.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    base = RESULTS / f"{stamp}-{args.name}"
    base.with_suffix(".json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    header = "| recipe | params after | achieved | " + " | ".join(f"{d} ppl" for d in datasets)
    lines = [header + " | compress s | peak MB |", "| --- " * (5 + len(datasets)) + "|"]
    for row in rows:
        ppl = " | ".join(f"{row['metrics'][f'{d}_ppl']:.4g}" for d in datasets)
        if row["params"] is None:
            lines.append(f"| dense | {dense_params(args.model)} | 0 | {ppl} | - | - |")
            continue
        stages = row["timings_s"]["stages"]
        compress = sum(v for k, v in stages.items() if k[0].isdigit())
        lines.append(
            f"| {row['recipe']} | {row['params']['after']:,} | {row['achieved']:.2%} | {ppl} | "
            f"{compress:.0f} | {row['peak_rss_mb']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    base.with_suffix(".md").write_text(f"Settings: {json.dumps(settings)}\n\n{text}")
    print(text)


def dense_params(model: str) -> str:
    import slimkit
    from slimkit.primitives.evaluate.counting import count_params

    return f"{count_params(slimkit.load_source(model)[0]):,}"


if __name__ == "__main__":
    main()
