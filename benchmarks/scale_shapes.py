"""The shapes ``python -m benchmarks.scale`` measures (real models' configs, depth and width sweeps, tiny ones) and
their random-weight models, saved once per shape and dtype.

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.core.errors import BenchError
from benchmarks.core.random_models import random_model
from slimkit.primitives.files.removal import discard, remove_owned


@dataclass(frozen=True)
class Shape:
    """A decoder shape; ``family`` is the Hugging Face ``model_type`` (llama or qwen2)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie: bool = True
    rope_theta: float = 10000.0
    family: str = "llama"
    rms_eps: float = 1e-5
    max_positions: int = 8192
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    kind: str = "real"  # real | depth | width | quick
    source: str = ""

    def config(self, dtype: str) -> Any:
        from transformers import AutoConfig

        values: dict[str, Any] = {
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tie,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_positions,
            "hidden_act": "silu",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": dtype,
        }
        if self.family == "llama":
            values["head_dim"] = self.head_dim
            if self.rope_scaling is not None:
                values["rope_scaling"] = dict(self.rope_scaling)
        assert self.hidden == self.heads * self.head_dim or self.family == "llama", self.name
        return AutoConfig.for_model(self.family, **values)

    def params(self) -> dict[str, int]:
        """Parameters by part, from the shape alone (embeddings, decoder layers, final norm, untied head)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * q + 2 * kv) + (q + 2 * kv if self.family == "qwen2" else 0)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embed = self.vocab * self.hidden
        total = embed * (1 if self.tie else 2) + self.layers * layer + self.hidden
        return {"total": total, "layers": self.layers * layer, "embedding": embed}


# Real shapes, from each model's config.json on the Hugging Face hub (HuggingFaceTB/SmolLM2-135M,
# HuggingFaceTB/SmolLM2-360M, meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-3B,
# meta-llama/Llama-3.1-8B): hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim, vocab_size, tie_word_embeddings, rope_theta (and Llama 3's rope_scaling),
# rms_norm_eps; Qwen2 has biases on q/k/v (built in by transformers' Qwen2 model).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
REAL: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("smollm2-135m", 576, 1536, 30, 9, 3, 64, 49152, True, 100000.0, source="HuggingFaceTB/SmolLM2-135M"),
        Shape("smollm2-360m", 960, 2560, 32, 15, 5, 64, 49152, True, 100000.0, source="HuggingFaceTB/SmolLM2-360M"),
        Shape(
            "llama-3.2-1b",
            2048,
            8192,
            16,
            32,
            8,
            64,
            128256,
            True,
            500000.0,
            max_positions=131072,
            rope_scaling=_LLAMA3_ROPE,
            source="meta-llama/Llama-3.2-1B",
        ),
        Shape(
            "qwen2.5-1.5b",
            1536,
            8960,
            28,
            12,
            2,
            128,
            151936,
            True,
            1000000.0,
            family="qwen2",
            rms_eps=1e-6,
            max_positions=131072,
            source="Qwen/Qwen2.5-1.5B",
        ),
        Shape(
            "llama-3.2-3b",
            3072,
            8192,
            28,
            24,
            8,
            128,
            128256,
            True,
            500000.0,
            max_positions=131072,
            rope_scaling=_LLAMA3_ROPE,
            source="meta-llama/Llama-3.2-3B",
        ),
        Shape(
            "llama-3.1-8b",
            4096,
            14336,
            32,
            32,
            8,
            128,
            128256,
            False,
            500000.0,
            max_positions=131072,
            rope_scaling=_LLAMA3_ROPE,
            source="meta-llama/Llama-3.1-8B",
        ),
    )
}
CPU_REAL = ("smollm2-135m", "smollm2-360m", "llama-3.2-1b", "qwen2.5-1.5b")
GPU_REAL = (*CPU_REAL, "llama-3.2-3b", "llama-3.1-8b")
OFFLOAD_SHAPE = "llama-3.2-1b"
OFFLOAD_MEMORY = "1.5GiB"


def depth_shape(layers: int, base: Shape, kind: str = "depth") -> Shape:
    return replace(base, name=f"{base.name.split('-L')[0]}-L{layers}", layers=layers, kind=kind, source="")


def width_shape(hidden: int, layers: int, vocab: int = 49152, kind: str = "width") -> Shape:
    """A llama shape of width ``hidden``: MLP 8/3 x hidden (to a multiple of 64), 64-wide heads, 4 per KV head."""
    heads = max(hidden // 64, 4)
    intermediate = max(64, round(hidden * 8 / 3 / 64) * 64)
    return Shape(
        f"w{hidden}-L{layers}",
        hidden,
        intermediate,
        layers,
        heads,
        max(heads // 4, 1),
        hidden // heads,
        vocab,
        True,
        100000.0,
        kind=kind,
    )


# Sweeps: depth at SmolLM2-135M's width; width at 8 layers (llm-pruner leaves its first 3 and last 2 dense).
DEPTHS = (8, 16, 32)
WIDTHS = (256, 512, 1024, 2048)
SWEEP_DEPTH = 8
QUICK_DEPTHS = (6, 12)
QUICK_WIDTHS = (64, 128)
BASELINE = replace(width_shape(64, 2), name="baseline-w64-L2", kind="baseline")


def sweep_shapes(quick: bool) -> list[tuple[Shape, list[str]]]:
    """The sweeps' shapes, each with the sweeps it belongs to (one shared by both is built and run once)."""
    if quick:
        depth = [width_shape(QUICK_WIDTHS[0], n, kind="depth") for n in QUICK_DEPTHS]
        width = [width_shape(h, QUICK_DEPTHS[0], kind="width") for h in QUICK_WIDTHS]
    else:
        depth = [depth_shape(n, REAL["smollm2-135m"]) for n in DEPTHS]
        width = [width_shape(h, SWEEP_DEPTH) for h in WIDTHS]
    member: dict[str, tuple[Shape, list[str]]] = {}
    for kind, shapes in (("depth", depth), ("width", width)):
        for shape in shapes:
            member.setdefault(shape.name, (shape, []))[1].append(kind)
    return list(member.values())


def synthetic_shape(name: str) -> Shape | None:
    """``wW-LL`` (e.g. ``w64-L4``): a llama shape of hidden W and L layers (:func:`width_shape`), for smoke tests."""
    match = re.fullmatch(r"w(\d+)-L(\d+)", name)
    if match is None or int(match[1]) < 64 or int(match[1]) % 64 or int(match[2]) < 1:
        return None
    return width_shape(int(match[1]), int(match[2]), kind="real")


def half_the_layers(shape: Shape, dtype: str) -> str:
    """A budget of the embeddings and half the decoder layers in ``dtype`` (the quick offload row's)."""
    params = shape.params()
    size = dtype_bytes(dtype)
    resident = (params["total"] - params["layers"]) * size
    return f"{(resident + params['layers'] * size // 2) // 1024}KiB"


def dtype_bytes(dtype: str) -> int:
    """Bytes per weight in ``dtype`` (float32, or a 16-bit type)."""
    return 4 if dtype == "float32" else 2


def resolve_dtype(device: str, dtype: str) -> str:
    """``dtype``, or for ``auto`` what a run on ``device`` uses: bfloat16 on CUDA, float32 on the CPU."""
    if dtype != "auto":
        return dtype
    import torch

    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda else "float32"


def build_device(device: str) -> str:
    """Where random weights are drawn: the GPU of a CUDA run (far faster than the CPU at 8B; the timing is in
    docs/methods/benchmark-harness.md), else the CPU."""
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return device if device.startswith("cuda") else "cuda"
    return "cpu"


def build_model(shape: Shape, dtype: str, folder: Path, tokenizer_dir: Path, device: str = "cpu") -> float:
    """Write ``shape`` with random weights drawn on ``device`` to ``folder`` (atomic); returns the seconds it took."""
    import gc

    import torch
    from transformers import AutoTokenizer

    from slimkit.primitives.files.atomic import staging_dir

    start = time.perf_counter()
    model = random_model(shape.config(dtype), dtype, device)
    tmp = staging_dir(folder)
    try:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
        os.replace(tmp, folder)
    finally:
        discard(tmp)
    del model
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the runs are other processes: give the GPU memory back
    return time.perf_counter() - start


def model_folder(
    shape: Shape, dtype: str, models_dir: Path, device: str = "cpu", tokenizer: Path | None = None
) -> tuple[Path, float | None]:
    """The saved random-weight model of ``shape`` in ``dtype`` (built on ``device`` on first use; seconds or None
    if cached); the tokenizer is ``tokenizer`` (a folder) or smollm2-135m's."""
    folder = models_dir / f"{shape.name}-{dtype}"
    stamp = folder / "scale-shape.json"
    wanted = json.dumps(asdict(shape) | {"dtype": dtype}, sort_keys=True, default=str)
    if stamp.is_file() and stamp.read_text() == wanted:
        return folder, None
    if os.path.lexists(folder):  # a stale model of another shape: deleted, never across a mount
        left = remove_owned(folder)
        if left:
            raise BenchError(f"--models-dir: cannot replace {folder}: it holds {left[0].phrase(folder)}")
    if tokenizer is None:
        from slimkit.primitives.io.model_sources import resolve_source

        tokenizer, _info = resolve_source("smollm2-135m")
    seconds = build_model(shape, dtype, folder, tokenizer, device)
    stamp.write_text(wanted)
    return folder, seconds
