"""CPU speed and memory of compressed models relative to a baseline, measured in one process.

``python -m benchmarks.speed smollm2-135m runs/wanda-channels/model --prompt-len 128 --new-tokens 32 --rounds 5``.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import slimkit
from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.outputs import write_text
from slimkit.primitives.evaluate.counting import count_macs, count_params
from slimkit.primitives.evaluate.speed import throughput

# Decode time is generate time minus prefill time (slimkit.primitives.evaluate.speed); on a machine
# that other jobs share, a slow prefill can exceed the whole generate call and the difference is
# clamped to ~0, i.e. an absurd rate. Such a sample is measured again, at most ATTEMPTS times.
IMPLAUSIBLE_TOKENS_PER_S = 1e6
ATTEMPTS = 3


def _sample(model: Any, vocab_size: int, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    result = None
    for _ in range(ATTEMPTS):
        result = throughput(model, vocab_size, batch, prompt_len, new_tokens, repeats=1)
        if result.decode_tokens_per_s < IMPLAUSIBLE_TOKENS_PER_S:
            return result.prefill_tokens_per_s, result.decode_tokens_per_s
    return (math.nan if result is None else result.prefill_tokens_per_s), math.nan


def _median(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def measure(
    models: list[tuple[str, Any, int]],
    rounds: int,
    prompt_len: int,
    new_tokens: int,
    batch: int = 1,
    sample: Callable[[Any], tuple[float, float]] | None = None,
) -> list[dict[str, Any]]:
    """Interleaved throughput of ``(name, model, vocab_size)`` triples (names unique): ``rounds`` rounds,
    each measuring every model once in an order rotated by one per round; per model the medians and
    their ratios to the first model's medians (a decode sample that stays implausible after
    ``ATTEMPTS`` tries is NaN and left out of the median). ``sample(model)`` replaces the PyTorch
    measurement with another backend's ``(prefill, decode)`` tokens/s."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _m, _v in models}
    for index in range(rounds):
        shift = index % len(models)
        for name, model, vocab_size in models[shift:] + models[:shift]:
            if sample is None:
                samples[name].append(_sample(model, vocab_size, batch, prompt_len, new_tokens))
            else:
                samples[name].append(sample(model))
    rows: list[dict[str, Any]] = []
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


def _llamacpp_models(
    loaded: list[tuple[str, Any, Any]], args: argparse.Namespace, folder: Path
) -> tuple[list[tuple[str, Any, int]], dict[str, dict[str, Any]]]:
    """Export every model to GGUF and load it in llama.cpp; ``(name, llama, vocab)`` and the export results."""
    from slimkit.primitives.errors import SlimkitError
    from slimkit.primitives.evaluate.llamacpp import load_gguf
    from slimkit.primitives.export import GgufResult, export

    handles: list[tuple[str, Any, int]] = []
    exports: dict[str, dict[str, Any]] = {}
    for index, (name, model, tokenizer) in enumerate(loaded):
        path = folder / f"{index}-{Path(name).parent.name or name}-{args.type}.gguf"
        try:
            result = export(model, path, "gguf", args.type, tokenizer=tokenizer, force=True)
            assert isinstance(result, GgufResult)
        except SlimkitError as error:
            print(f"{name}: not exported: {error}")
            exports[name] = {"error": str(error)}
            continue
        exports[name] = {k: v for k, v in result.as_dict().items() if k != "fallbacks"} | {
            "fallback_tensors": len(result.fallbacks)
        }
        handles.append((name, load_gguf(path, args.prompt_len + args.new_tokens, threads=args.threads), 0))
    return handles, exports


def _window_perplexities(loaded: list[tuple[str, Any, Any]], exports: dict[str, dict[str, Any]], tokens: int) -> None:
    """Perplexity of one WikiText-2 window in PyTorch and in llama.cpp, into each export record."""
    from slimkit.primitives.datasets import textdata
    from slimkit.primitives.evaluate.llamacpp import gguf_logits, nll_perplexity
    from slimkit.primitives.evaluate.perplexity import corpus_ids

    for name, model, tokenizer in loaded:
        record = exports.get(name, {})
        if "path" not in record:
            continue
        ids = corpus_ids(tokenizer, textdata.text("wikitext2"), tokens)[:tokens]
        with torch.no_grad():
            record["ppl_torch"] = nll_perplexity(model(ids[None]).logits[0], ids)
        record["ppl_llamacpp"] = nll_perplexity(gguf_logits(record["path"], ids.tolist()), ids)
        record["ppl_tokens"] = tokens


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.speed", __doc__)
    parser.add_argument(
        "models", nargs="+", type=arg.model_source, help="model sources or folders; the first is the baseline"
    )
    parser.add_argument("--prompt-len", type=arg.integer(1), default=128)
    parser.add_argument("--new-tokens", type=arg.integer(1), default=32)
    parser.add_argument("--batch", type=arg.integer(1), default=1)
    parser.add_argument("--rounds", type=arg.integer(1), default=5)
    parser.add_argument("--threads", type=arg.integer(1), default=torch.get_num_threads())
    parser.add_argument("--backend", choices=["torch", "llama.cpp"], default="torch")
    parser.add_argument(
        "--type", type=arg.gguf_type, default="f16", help="GGUF type for --backend llama.cpp (f32, f16, bf16, q8_0)"
    )
    parser.add_output_folder("--gguf-dir", "the exported GGUF files", help="keep the exported GGUF files here")
    parser.add_argument(
        "--ppl-tokens",
        type=arg.integer(0),
        default=0,
        help="llama.cpp: also the perplexity of each GGUF and of the PyTorch model on one window of this many "
        "WikiText-2 tokens (same token ids)",
    )
    parser.add_output_file("--json", help="also write the settings and rows here")
    return parser


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    torch.set_num_threads(args.threads)

    loaded = [(name, *slimkit.load_source(name)[:2]) for name in args.models]
    exports: dict[str, dict[str, Any]] = {}
    if args.backend == "llama.cpp":
        from slimkit.primitives.evaluate.llamacpp import gguf_throughput

        with tempfile.TemporaryDirectory(prefix="slimkit-speed-") as scratch:
            folder = args.gguf_dir or Path(scratch)
            folder.mkdir(parents=True, exist_ok=True)
            handles, exports = _llamacpp_models(loaded, args, folder)

            def sample(llama: Any) -> tuple[float, float]:
                result = gguf_throughput(llama, args.prompt_len, args.new_tokens, args.threads, repeats=1)
                return result["prefill_tokens_per_s"], result["decode_tokens_per_s"]

            measured = measure(handles, args.rounds, args.prompt_len, args.new_tokens, 1, sample)
            for _name, llama, _vocab in handles:
                llama.close()
            if args.ppl_tokens:
                _window_perplexities(loaded, exports, args.ppl_tokens)
        kept = {row["model"] for row in measured}
        loaded = [item for item in loaded if item[0] in kept]
    else:
        measured = measure(
            [(name, model, len(tokenizer)) for name, model, tokenizer in loaded],
            args.rounds,
            args.prompt_len,
            args.new_tokens,
            args.batch,
        )
    rows = []
    for (_name, model, _tokenizer), row in zip(loaded, measured, strict=True):
        extra = {"export": exports[row["model"]]} if row["model"] in exports else {}
        rows.append({**row, "params": count_params(model), "macs": count_macs(model, args.prompt_len), **extra})
    print(f"| model | params | MACs ({args.prompt_len} tok) | prefill tok/s | decode tok/s | prefill x | decode x |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['model']} | {row['params']:,} | {row['macs']:,} | {row['prefill_tokens_per_s']:.1f} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['prefill_ratio']:.2f} | {row['decode_ratio']:.2f} |"
        )
    for name, record in exports.items():
        if "ppl_llamacpp" in record:
            print(
                f"{name}: perplexity on {record['ppl_tokens']} WikiText-2 tokens: PyTorch {record['ppl_torch']:.3f}, "
                f"llama.cpp {record['ppl_llamacpp']:.3f} ({record['type']}, {record['bytes'] / 2**20:.1f} MiB)"
            )
    if args.json is not None:
        keys = ("prompt_len", "new_tokens", "batch", "rounds", "threads", "backend")
        settings = {k: getattr(args, k) for k in keys}
        if args.backend == "llama.cpp":
            settings["type"] = args.type
        failed = {name: item["error"] for name, item in exports.items() if "error" in item}
        text = json.dumps({"settings": settings, "rows": rows, "not_exported": failed}, indent=2) + "\n"
        write_text(args.json, text, "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
