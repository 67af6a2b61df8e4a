"""CPU speed and memory of compressed models relative to a baseline, measured in one process.

    python -m benchmarks.speed smollm2-135m runs/wanda-channels/model [more models...] \
        --prompt-len 128 --new-tokens 32 --rounds 5

Each round measures every model once (prefill tokens/s, greedy decode tokens/s), so models are
interleaved and share the machine's state; the table gives the median of the rounds and the ratio to
the first model. Parameters and MACs come from :mod:`slimkit.primitives.evaluate.counting`. Numbers
are ratios for this machine and run, not absolute claims. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import slimkit
from slimkit.primitives.evaluate.counting import count_macs, count_params
from slimkit.primitives.evaluate.speed import throughput


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
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in args.models}
    for _ in range(args.rounds):
        for name, model, tokenizer in loaded:
            result = throughput(model, len(tokenizer), args.batch, args.prompt_len, args.new_tokens, repeats=1)
            samples[name].append((result.prefill_tokens_per_s, result.decode_tokens_per_s))

    rows = []
    for name, model, _tokenizer in loaded:
        prefill = statistics.median(s[0] for s in samples[name])
        decode = statistics.median(s[1] for s in samples[name])
        rows.append(
            {
                "model": name,
                "params": count_params(model),
                "macs": count_macs(model, args.prompt_len),
                "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode,
            }
        )
    base = rows[0]
    print(f"| model | params | MACs ({args.prompt_len} tok) | prefill tok/s | decode tok/s | prefill x | decode x |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        row["prefill_ratio"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        row["decode_ratio"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        print(
            f"| {row['model']} | {row['params']:,} | {row['macs']:,} | {row['prefill_tokens_per_s']:.1f} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['prefill_ratio']:.2f} | {row['decode_ratio']:.2f} |"
        )
    if args.json is not None:
        settings = {k: getattr(args, k) for k in ("prompt_len", "new_tokens", "batch", "rounds", "threads")}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
