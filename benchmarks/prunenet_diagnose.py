"""Why does a PruneNet policy keep what it keeps? Spectral penalty of row choices, from the weights alone.

``python -m benchmarks.prunenet_diagnose --model smollm2-135m --ratio 0.2 --seeds 0 1 2``.

Method note: docs/methods/prunenet-policy.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, cast

import torch

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.outputs import json_text, write_text
from slimkit.primitives.policy.prunenet import (
    RETURNS,
    UPDATES,
    PruneNetPolicy,
    Returns,
    Update,
    ffn_weights,
    layer_penalties,
    train_policy,
)
from slimkit.primitives.select import keep_count
from slimkit.primitives.spectrum import DISTANCES, singular_values


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def norm_penalty(weights: list[torch.Tensor], ratio: float, largest: bool, distance: str = "ks") -> float:
    """Mean over layers of the penalty when the rows with the largest (or smallest) L2 norm are kept."""
    out = []
    for w in weights:
        count = keep_count(w.shape[0], ratio)
        keep = torch.topk(w.norm(dim=1), count, largest=largest).indices.sort().values
        out.append(DISTANCES[distance](singular_values(w), singular_values(w[keep])))
    return _mean(out)


def logit_stats(policy: PruneNetPolicy, weights: list[torch.Tensor], seed: int) -> dict[str, float]:
    """Mean over layers of the logits' std over rows, the logistic noise's std, and corr(logit, row norm)."""
    stds, corrs, noise = [], [], []
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in weights:
            logits = policy.logits(w).double()
            norms = w.double().norm(dim=1)
            stds.append(float(logits.std()))
            corrs.append(float(torch.corrcoef(torch.stack([logits, norms]))[0, 1]))
            eps = torch.rand(w.shape[0], generator=g, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
            noise.append(float(torch.logit(eps).std()))
    return {"logit_std": _mean(stds), "noise_std": _mean(noise), "corr_logit_norm": _mean(corrs)}


def variant(text: str) -> str:
    """``RETURNS:UPDATE`` (e.g. ``future:episode``): a policy-gradient variant of :func:`train_policy`."""
    returns, _, update = text.partition(":")
    if returns not in RETURNS or update not in UPDATES:
        raise argparse.ArgumentTypeError(f"'{text}': use RETURNS:UPDATE with RETURNS in {RETURNS}, UPDATE in {UPDATES}")
    return text


def diagnose(
    weights: list[torch.Tensor], ratio: float, seeds: list[int], variants: list[str], episodes: int, draws: int = 20
) -> list[dict[str, Any]]:
    """One row per selection rule (see the module docstring)."""
    n, d = weights[0].shape
    rows: list[dict[str, Any]] = []
    random_means = []
    g = torch.Generator().manual_seed(seeds[0])
    for _ in range(draws):
        random_means.append(_mean(layer_penalties(PruneNetPolicy(n, d), weights, ratio, "random", g)))
    rows.append({"rule": "random", "ks_mean": _mean(random_means), "ks_std": _std(random_means), "n": draws})
    print(f"random: {rows[-1]}", flush=True)
    for largest, name in ((True, "norm-top"), (False, "norm-bottom")):
        rows.append({"rule": name, "ks_mean": norm_penalty(weights, ratio, largest), "ks_std": 0.0, "n": 1})
    for name in variants:
        returns, _, update = cast(tuple[Returns, str, Update], name.partition(":"))
        sampled, top, stats, curves, secs = [], [], [], [], []
        for seed in seeds:
            start = time.perf_counter()
            policy, report = train_policy(weights, ratio, episodes=episodes, seed=seed, returns=returns, update=update)
            secs.append(time.perf_counter() - start)
            g = torch.Generator().manual_seed(10_000 + seed)
            sampled.append(_mean(layer_penalties(policy, weights, ratio, "policy", g)))
            top.append(_mean(layer_penalties(policy, weights, ratio, "deterministic")))
            stats.append(logit_stats(policy, weights, seed))
            curves.append([report.episode_penalty[0], report.episode_penalty[-1]])
            print(f"{name} seed {seed}: policy {sampled[-1]:.4f}, top-k {top[-1]:.4f}, {stats[-1]}", flush=True)
        for rule, values in (("policy", sampled), ("deterministic", top)):
            row: dict[str, Any] = {
                "rule": f"{name} {rule}",
                "ks_mean": _mean(values),
                "ks_std": _std(values),
                "n": len(seeds),
            }
            row.update({key: _mean([s[key] for s in stats]) for key in stats[0]})
            row["episode_penalty_first_last"] = [_mean([c[0] for c in curves]), _mean([c[1] for c in curves])]
            row["train_seconds"] = _mean(secs)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| rule | mean KS | std | draws/seeds | logit std | noise std | corr(logit, norm) | train KS first->last |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        extra = [f"{r[k]:.3f}" if k in r else "-" for k in ("logit_std", "noise_std", "corr_logit_norm")]
        curve = r.get("episode_penalty_first_last")
        curve_text = f"{curve[0]:.4f} -> {curve[1]:.4f}" if curve else "-"
        lines.append(
            f"| {r['rule']} | {r['ks_mean']:.4f} | {r['ks_std']:.4f} | {r['n']} | {' | '.join(extra)} | {curve_text} |"
        )
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.prunenet_diagnose", __doc__)
    parser.add_argument("--model", type=arg.model_source, default="smollm2-135m")
    parser.add_argument("--source", default="up", choices=["up", "gate", "down"])
    parser.add_argument("--ratio", type=arg.fraction, default=0.2)
    parser.add_argument("--episodes", type=arg.integer(1), default=20)
    parser.add_argument("--seeds", type=arg.integer(0), nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", type=variant, nargs="*", default=["future:episode", "own:episode", "own:layer"])
    parser.add_argument("--random-draws", type=arg.integer(1), default=20)
    parser.add_argument("--threads", type=arg.integer(1), default=1)
    parser.add_output_file("--json")
    return parser


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    torch.set_num_threads(args.threads)
    from slimkit.primitives.io.model_sources import load_source

    model, _, _ = load_source(args.model, device="cpu", dtype="float32")
    weights = [w.float().contiguous() for w in ffn_weights(model, args.source)]
    del model
    rows = diagnose(weights, args.ratio, args.seeds, args.variants, args.episodes, args.random_draws)
    settings = (
        f"{args.model}, source {args.source}, ratio {args.ratio}, {args.episodes} episodes, "
        f"seeds {args.seeds}, lr 5e-4, gamma 0.99, KS, float32; noise std theory {math.pi / math.sqrt(3):.3f}"
    )
    print(settings)
    print(markdown(rows))
    if args.json is not None:
        write_text(args.json, json_text({"settings": settings, "rows": rows}), "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
