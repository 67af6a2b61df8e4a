"""How closely llama.cpp reproduces a model slimkit exported to GGUF: PyTorch vs llama.cpp on one text.

    python -m benchmarks.gguf_fidelity FOLDER [--gguf-file NAME.gguf] [--text TEXT] [--per-layer] [--out DIR]

``FOLDER`` is anything transformers loads (a Hugging Face folder, or with ``--gguf-file`` a GGUF file it
dequantises, e.g. the Gemma 3 270M package's file). With ``--per-layer`` the model first gets per-layer MLP widths
(every third layer full, the others 1/8 and 2/8 narrower, first channels kept) and one layer with half its query
heads, so architectures whose GGUF needs padding (gemma3, granite, olmo2) are checked through it. The model is
exported as float32 GGUF and both engines score the text's tokens: the largest logit difference relative to the
largest logit, and the perplexity of each, with llama.cpp's float16 and float32 KV caches. CPU only; a 270M model
takes about two minutes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from slimkit.primitives.arch import ModelView
from slimkit.primitives.evaluate.llamacpp import gguf_logits
from slimkit.primitives.export import GgufResult, export
from slimkit.primitives.surgery import prune_layer

TEXT = (
    "The capital of France is Paris. The river that runs through the city is the Seine, and its most famous tower "
    "was built for the world's fair of 1889."
)


def per_layer_widths(model: torch.nn.Module) -> None:
    """Per-layer MLP widths and one layer with half its query heads (kept: the first units)."""
    view = ModelView(model)
    for layer in view.layers:
        cut = layer.mlp_width // 8 * (layer.index % 3)
        prune_layer(model, "mlp_channel", layer.index, torch.arange(layer.mlp_width - cut))
    layer = view.layer(min(3, view.num_layers - 1))
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:  # half the query heads of every KV group
        keep = [g * group + i for g in range(layer.num_kv_heads) for i in range(group // 2)]
        prune_layer(model, "attention_head", layer.index, torch.tensor(keep))


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(ids[1:])[:, None]
    return float((-log_probs.gather(1, targets).mean()).exp())


def measure(model: torch.nn.Module, tokenizer: Any, text: str, folder: Path) -> dict[str, Any]:
    ids = tokenizer(text).input_ids
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float()
    path = folder / "model-f32.gguf"
    result = export(model, path, "gguf", "f32", tokenizer=tokenizer, force=True)
    assert isinstance(result, GgufResult)
    row: dict[str, Any] = {"architecture": result.architecture, "warnings": result.warnings, "tokens": len(ids)}
    row["torch_perplexity"] = _perplexity(expected, ids)
    for cache in ("f16", "f32"):
        actual = torch.tensor(gguf_logits(path, ids, threads=2, f32_cache=cache == "f32"))
        row[f"llamacpp_{cache}_cache"] = {
            "max_rel_logit_diff": float((actual - expected).abs().max() / expected.abs().max().clamp(min=1.0)),
            "perplexity": _perplexity(actual, ids),
        }
    return row


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.gguf_fidelity", __doc__)
    parser.add_argument("folder", type=arg.input_folder)
    parser.add_argument("--gguf-file", default=None, help="a GGUF file in FOLDER for transformers to dequantise")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--per-layer", action="store_true", help="give the model per-layer widths first")
    parser.add_output_folder("--out", "GGUF files", help="folder for the GGUF file (default: a temporary one)")
    return parser


def main_body(argv: list[str]) -> None:
    args = build_parser().parse(argv)
    if args.gguf_file is not None and not (args.folder / args.gguf_file).is_file():
        raise BenchError(f"--gguf-file {args.gguf_file}: no such file in {args.folder}")
    if args.gguf_file is None and not (args.folder / "config.json").is_file():
        raise BenchError(f"{args.folder} has no config.json; give a model folder (or a GGUF file in it, --gguf-file)")
    extra = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.folder, **extra)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, **extra).eval()
    if args.per_layer:
        per_layer_widths(model)
    with tempfile.TemporaryDirectory(prefix="slimkit-fidelity-") as tmp:
        folder = args.out if args.out is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        print(json.dumps(measure(model, tokenizer, args.text, folder), indent=2))


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    raise SystemExit(main())
