"""The per-layer work of ``prunenet`` and ``sp3-llm`` at a real shape, timed on one layer of random weights.

    python -m benchmarks.prunenet_sp3_cost                      # Llama-3.1-8B's widths, on the CPU, float32
    python -m benchmarks.prunenet_sp3_cost --device cuda --dtype bfloat16
    python -m benchmarks.prunenet_sp3_cost --quick              # tiny widths (the smoke test)

Both recipes repeat a per-layer operation many times, so one layer of the real widths says what a whole run costs:
``prunenet`` computes each layer's full FFN1 spectrum once and the kept rows' spectrum once per layer per episode
(``svd``: ``svdvals`` of the kept rows; ``gram``: the eigenvalues of their hidden x hidden Gram), plus one policy
step per layer per episode; ``sp3-llm``'s ``mask_train`` runs a forward and backward of every layer and the head per
step, with or without the weights' gradients and their AdamW step. Each variant is timed in the same process; the
counts per run and the projection (counts x the times measured here) are printed and written with ``--json``.
Random weights: cost only. Method notes: docs/methods/prunenet-policy.md, docs/methods/sp3-mask-training.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.core import arguments as arg
from benchmarks.core.arguments import OneLineParser, bench_main
from benchmarks.core.errors import BenchError
from benchmarks.core.outputs import emit_json
from benchmarks.core.processes import load_average


def _timed(run: Callable[[], Any], device: str) -> tuple[float, Any]:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def prunenet_layer(args: argparse.Namespace) -> dict[str, Any]:
    """One layer's spectra by each method (and their KS agreement) and one policy step (``update: layer``)."""
    import torch

    from slimkit.primitives.policy.prunenet import PruneNetPolicy
    from slimkit.primitives.select import keep_count
    from slimkit.primitives.spectrum import SpectrumMethod, ks_distance, singular_values

    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.intermediate, args.hidden, generator=generator) * 0.02).to(args.device, dtype)
    kept = torch.randperm(args.intermediate, generator=generator)[: keep_count(args.intermediate, args.ratio)]
    rows = weight[kept.sort().values.to(args.device)]
    out: dict[str, Any] = {"kept_rows": rows.shape[0]}
    spectra = {}
    variants: tuple[tuple[str, SpectrumMethod, torch.dtype], ...] = (
        ("gram_float32", "gram", torch.float32),
        ("gram_float64", "gram", torch.float64),
        ("svd_float32", "svd", torch.float32),
    )
    for name, method, precision in variants:
        if method == "svd" and args.skip_svd:
            continue
        seconds, values = _timed(functools.partial(singular_values, rows, precision, method), args.device)
        out[f"kept_{name}_s"] = seconds
        spectra[name] = values
        print(f"prunenet: kept-row spectrum ({name}): {seconds:.2f} s", flush=True)
    out["full_gram_float32_s"], reference = _timed(lambda: singular_values(weight, torch.float32, "gram"), args.device)
    for name, values in spectra.items():
        out[f"ks_{name}"] = ks_distance(reference, values)
    if "svd_float32" in spectra:
        top = spectra["svd_float32"].double()
        out["max_relative_difference_gram_float32_vs_svd"] = float(
            ((spectra["gram_float32"].double() - top).abs() / top).max()
        )
    policy = PruneNetPolicy(args.intermediate, args.hidden, generator=generator).to(args.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=5e-4, weight_decay=0.01)

    def step() -> None:
        with torch.no_grad():
            order, _log_prob, eps = policy.sample_with_noise(weight, rows.shape[0], generator)
        loss = policy.log_prob(weight, order, eps) * 0.1
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # AdamW's state is created on the first step
    out["policy_step_s"] = _timed(step, args.device)[0]
    print(f"prunenet: policy step: {out['policy_step_s']:.2f} s", flush=True)
    layers, episodes = args.layers, args.episodes
    out["counts"] = {"full_spectra": layers, "kept_spectra": layers * episodes, "policy_steps": layers * episodes}
    for name in spectra:
        out[f"projected_{name}_s"] = layers * out["full_gram_float32_s"] + layers * episodes * (
            out[f"kept_{name}_s"] + out["policy_step_s"]
        )
    return out


def sp3_layer(args: argparse.Namespace) -> dict[str, Any]:
    """One decoder layer's forward + backward at the training batch with the weights trainable or frozen, the head's,
    and one AdamW step with float32 masters over the layer's weights."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from slimkit.primitives.finetune.loop import FloatMaster, master_step

    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_hidden_layers=1,
        vocab_size=args.vocab,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        layer = LlamaDecoderLayer(config, 0).to(dtype)
        rotary = LlamaRotaryEmbedding(config)
        head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dtype)
    batch, seq = args.batch_size, args.seq_len
    hidden = torch.randn(batch, seq, args.hidden, device=args.device, dtype=dtype)
    positions = torch.arange(seq, device=args.device).unsqueeze(0)
    embeddings = rotary(hidden, positions)
    mask = None

    def layer_pass() -> None:
        x = hidden.detach().requires_grad_(True)
        y = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
        y = y[0] if isinstance(y, tuple) else y
        y.float().square().mean().backward()

    def head_pass() -> None:
        x = hidden.detach().requires_grad_(True)
        logits = head(x).float()
        labels = torch.zeros(batch * seq, dtype=torch.long, device=args.device)
        torch.nn.functional.cross_entropy(logits.view(-1, args.vocab), labels).backward()

    out: dict[str, Any] = {"tokens": batch * seq}
    head.requires_grad_(False)
    for trainable in (True, False):
        key = f"layer_forward_backward_{'weights' if trainable else 'frozen'}_s"
        layer.requires_grad_(trainable)
        layer.zero_grad(set_to_none=True)
        layer_pass()  # warm-up
        out[key] = _timed(layer_pass, args.device)[0]
        print(f"sp3-llm: {key}: {out[key]:.2f} s", flush=True)
    layer.zero_grad(set_to_none=True)
    out["head_forward_backward_frozen_s"] = _timed(head_pass, args.device)[0]
    print(f"sp3-llm: head fwd+bwd (frozen): {out['head_forward_backward_frozen_s']:.2f} s", flush=True)
    layer.requires_grad_(True)
    layer_pass()
    master = FloatMaster(list(layer.parameters()))
    optimizer = torch.optim.AdamW(master.params, lr=1e-5, weight_decay=0.0)
    master_step(master, optimizer, 1.0)  # AdamW's state is created on the first step
    out["layer_adamw_step_s"] = _timed(lambda: master_step(master, optimizer, 1.0), args.device)[0]
    print(f"sp3-llm: layer AdamW step: {out['layer_adamw_step_s']:.2f} s", flush=True)
    layer_params = sum(p.numel() for p in layer.parameters())
    out["layer_params"] = layer_params
    steps, layers = args.mask_steps, args.layers
    out["counts"] = {"steps": steps, "layer_passes": steps * layers, "head_passes": steps}
    for kind in ("weights", "frozen"):
        per_step = layers * out[f"layer_forward_backward_{kind}_s"] + out["head_forward_backward_frozen_s"]
        if kind == "weights":
            per_step += layers * out["layer_adamw_step_s"]
        out[f"projected_step_{kind}_s"] = per_step
        out[f"projected_run_{kind}_s"] = steps * per_step
    return out


def build_parser() -> OneLineParser:
    parser = OneLineParser("benchmarks.prunenet_sp3_cost", __doc__)
    parser.add_argument("--device", type=arg.device, default="cpu")
    parser.add_argument("--dtype", type=arg.dtype, default="float32", help="the weights' dtype (bfloat16 on a GPU)")
    for option, default in (("--hidden", 4096), ("--intermediate", 14336), ("--heads", 32), ("--kv-heads", 8)):
        parser.add_argument(option, type=arg.integer(1), default=default)
    parser.add_argument("--head-dim", type=arg.integer(1), default=128)
    parser.add_argument("--vocab", type=arg.integer(1), default=128256)
    parser.add_argument("--layers", type=arg.integer(1), default=32, help="decoder layers of the projected run")
    parser.add_argument("--ratio", type=arg.fraction, default=0.2, help="prunenet's removed fraction of MLP channels")
    parser.add_argument("--episodes", type=arg.integer(1), default=20, help="prunenet's episodes (the recipe's 20)")
    parser.add_argument("--mask-steps", type=arg.integer(1), default=600, help="sp3-llm's mask steps (the recipe's)")
    parser.add_argument("--batch-size", type=arg.integer(1), default=4, help="sp3-llm's training windows per step")
    parser.add_argument("--seq-len", type=arg.integer(1), default=128, help="sp3-llm's tokens per window")
    parser.add_argument("--skip-svd", action="store_true", help="do not time svdvals (minutes at 8B on a CPU)")
    parser.add_argument("--only", choices=("prunenet", "sp3"), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny widths (hidden 64, MLP 176, vocab 512)")
    parser.add_output_file("--json", help="write the measurements here")
    return parser


def main_body(argv: list[str]) -> None:
    import torch

    args = build_parser().parse(argv)
    if args.quick:
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.vocab = 64, 176, 4, 2, 16, 512
    if args.heads % args.kv_heads:
        raise BenchError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    result: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_start": load_average(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    }
    if args.only in (None, "prunenet"):
        result["prunenet"] = prunenet_layer(args)
    if args.only in (None, "sp3"):
        result["sp3"] = sp3_layer(args)
    result["load_average_end"] = load_average()
    emit_json(result, args.json, "--json")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, main_body)


if __name__ == "__main__":
    sys.exit(main())
