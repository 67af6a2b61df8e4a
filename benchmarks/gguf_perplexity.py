"""Perplexity of a model in PyTorch and of its GGUF export in llama.cpp, on the same evaluation windows.

    python -m benchmarks.gguf_perplexity SOURCE [--dataset wikitext2] [--max-tokens 16384] [--seq-len 512]
        [--type f32] [--f32-cache] [--out DIR] [--json FILE]

``SOURCE`` is anything ``slimkit.load`` reads (a named source, a run's output folder). The windows are the ones
``slimkit eval`` scores (the corpus tokenised once, consecutive windows, each started with the tokenizer's BOS where
it adds one); PyTorch scores them in float32, the model is exported to GGUF (``--type``) and llama.cpp scores every
window from an empty cache. Prints both perplexities and their relative difference. CPU only.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import slimkit
from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import emit_json
from slimkit.primitives.datasets import textdata
from slimkit.primitives.evaluate.eval_settings import PERPLEXITY_MAX_TOKENS, PERPLEXITY_SEQ_LEN
from slimkit.primitives.evaluate.llamacpp import gguf_perplexity_of_windows
from slimkit.primitives.evaluate.perplexity import bos_prefix, corpus_ids, perplexity_of_windows, windows_of
from slimkit.primitives.export import GgufResult, export


def measure(model: torch.nn.Module, tokenizer: Any, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    ids = corpus_ids(tokenizer, textdata.text(args.dataset), args.max_tokens)
    windows = windows_of(ids, args.seq_len, args.max_tokens, bos_prefix(tokenizer))
    start = time.perf_counter()
    torch_ppl = perplexity_of_windows(model, windows)
    torch_s = time.perf_counter() - start
    path = folder / f"model-{args.type}.gguf"
    result = export(model, path, "gguf", args.type, tokenizer=tokenizer, force=True)
    assert isinstance(result, GgufResult)
    start = time.perf_counter()
    llamacpp_ppl = gguf_perplexity_of_windows(path, windows, threads=args.threads, f32_cache=args.f32_cache)
    return {
        "dataset": args.dataset,
        "windows": int(windows.shape[0]),
        "seq_len": args.seq_len,
        "tokens": int(windows.numel()),
        "gguf": {"architecture": result.architecture, "type": args.type, "bytes": path.stat().st_size},
        "warnings": result.warnings,
        "kv_cache": "f32" if args.f32_cache else "f16",
        "torch_perplexity": torch_ppl,
        "llamacpp_perplexity": llamacpp_ppl,
        "relative_difference": llamacpp_ppl / torch_ppl - 1,
        "seconds": {"torch": round(torch_s, 1), "llamacpp": round(time.perf_counter() - start, 1)},
    }


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.gguf_perplexity", __doc__)
    parser.add_argument("source", type=arg.model_source)
    parser.add_argument("--dataset", type=arg.corpus, default="wikitext2")
    parser.add_argument("--max-tokens", type=arg.integer(2), default=PERPLEXITY_MAX_TOKENS)
    parser.add_argument("--seq-len", type=arg.integer(2), default=PERPLEXITY_SEQ_LEN)
    parser.add_argument("--type", type=arg.gguf_type, default="f32", help="GGUF type (f32, f16, bf16, q8_0)")
    parser.add_argument("--f32-cache", action="store_true", help="llama.cpp keeps keys and values in float32")
    parser.add_argument("--threads", type=arg.integer(1), default=torch.get_num_threads())
    parser.add_output_folder("--out", "GGUF files", help="folder for the GGUF file (default: a temporary one)")
    parser.add_output_file("--json", help="also write the row here")
    return parser


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    if args.max_tokens < args.seq_len:
        raise BenchError(f"--max-tokens {args.max_tokens} is below one window of --seq-len {args.seq_len}")
    model, tokenizer, _info = slimkit.load_source(args.source, device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory(prefix="slimkit-gguf-ppl-") as tmp:
        folder = args.out if args.out is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        row = {"source": args.source} | measure(model, tokenizer, args, folder)
    emit_json(row, args.json, "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
