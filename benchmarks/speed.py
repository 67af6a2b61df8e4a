"""CPU speed and memory of compressed models relative to a baseline, measured in one process.

    python -m benchmarks.speed smollm2-135m runs/wanda-channels/model [more models...] \
        --prompt-len 128 --new-tokens 32 --rounds 5

Each round measures every model once (prefill tokens/s, greedy decode tokens/s), so models are
interleaved and share the machine's state; the order is rotated from round to round so no model is
always measured first. The table gives the median of the rounds and the ratio to the first model.
:func:`measure` is the same measurement for callers that hold the models (``benchmarks.run`` pairs
every compressed model with the dense one). Parameters and MACs come from
:mod:`slimkit.primitives.evaluate.counting`. Numbers are ratios for this machine and run, not absolute
claims. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

import slimkit
from slimkit.primitives.evaluate.counting import count_macs, count_params
from slimkit.primitives.evaluate.speed import throughput

# Decode time is generate time minus prefill time (slimkit.primitives.evaluate.speed); on a machine
# that other jobs share, a slow prefill can exceed the whole generate call and the difference is
# clamped to ~0, i.e. an absurd rate. Such a sample is measured again, at most ATTEMPTS times.
IMPLAUSIBLE_TOKENS_PER_S = 1e6
ATTEMPTS = 3


def _sample(model, vocab_size: int, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    for _ in range(ATTEMPTS):
        result = throughput(model, vocab_size, batch, prompt_len, new_tokens, repeats=1)
        if result.decode_tokens_per_s < IMPLAUSIBLE_TOKENS_PER_S:
            return result.prefill_tokens_per_s, result.decode_tokens_per_s
    return result.prefill_tokens_per_s, math.nan


def _median(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def measure(
    models: list[tuple[str, Any, int]], rounds: int, prompt_len: int, new_tokens: int, batch: int = 1
) -> list[dict[str, Any]]:
    """Interleaved throughput of ``(name, model, vocab_size)`` triples (names unique): ``rounds`` rounds,
    each measuring every model once in an order rotated by one per round; per model the medians and
    their ratios to the first model's medians (a decode sample that stays implausible after
    ``ATTEMPTS`` tries is NaN and left out of the median)."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _m, _v in models}
    for index in range(rounds):
        shift = index % len(models)
        for name, model, vocab_size in models[shift:] + models[:shift]:
            samples[name].append(_sample(model, vocab_size, batch, prompt_len, new_tokens))
    rows = []
    for name, _model, _vocab in models:
        rows.append(
            {
                "model": name,
                "prefill_tokens_per_s": _median(s[0] for s in samples[name]),
                "decode_tokens_per_s": _median(s[1] for s in samples[name]),
                "prefill_samples": [s[0] for s in samples[name]],
                "decode_samples": [s[1] for s in samples[name]],
            }
        )
    base = rows[0]
    for row in rows:
        row["prefill_ratio"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        row["decode_ratio"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model sources or folders; the first is the baseline")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = [(name, *slimkit.load_source(name)[:2]) for name in args.models]
    measured = measure(
        [(name, model, len(tokenizer)) for name, model, tokenizer in loaded],
        args.rounds,
        args.prompt_len,
        args.new_tokens,
        args.batch,
    )
    rows = []
    for (_name, model, _tokenizer), row in zip(loaded, measured, strict=True):
        rows.append({**row, "params": count_params(model), "macs": count_macs(model, args.prompt_len)})
    print(f"| model | params | MACs ({args.prompt_len} tok) | prefill tok/s | decode tok/s | prefill x | decode x |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['model']} | {row['params']:,} | {row['macs']:,} | {row['prefill_tokens_per_s']:.1f} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['prefill_ratio']:.2f} | {row['decode_ratio']:.2f} |"
        )
    if args.json is not None:
        settings = {k: getattr(args, k) for k in ("prompt_len", "new_tokens", "batch", "rounds", "threads")}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
