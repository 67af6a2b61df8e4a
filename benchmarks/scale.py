"""How compression cost grows with model size: random-weight models of real shapes, cost only.

    python -m benchmarks.scale                      # the real shapes + depth/width sweeps + offload rows
    python -m benchmarks.scale --quick              # tiny shapes only (the smoke test; under a minute)

Method note: docs/methods/benchmark-harness.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import queue as queue_module
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.grid import BenchError
from benchmarks.inputs import check_folder_option, read_json_file
from benchmarks.run import (
    OFFLINE_ENV,
    QUIET_ENV,
    RESULTS,
    bench_main,
    last_line,
    log,
    machine_info,
    via_launcher,
)
from benchmarks.scale_jobs import (
    MEMORY_FRACTION,
    PLAN_MARGIN,
    PROCESS_BYTES,
    Demand,
    blocked_by,
    expected_peak,
    rerun_alone,
)
from slimkit.primitives.files.removal import discard, remove_owned

RECIPES = ("lorap", "wanda-channels", "llm-pruner", "sp3-oneshot")
RECOVERY_STAGES = frozenset({"lora", "distill"})
"""Stages a cost run drops: recovery training after the compression (its cost is the training budget's)."""
OFFLOAD_RECIPES = ("wanda-channels", "lorap")
"""Layer-wise recipes only: whole-model stages (Taylor gradients, a global PCA) are refused on an offloaded model."""
RATIO = 0.2
STATEMENT = (
    "Random weights: these rows measure compression cost (time, memory) only, not quality; "
    "perplexity of a random-weight model is meaningless and is not measured."
)


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

    def config(self, dtype: str):
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
QUICK_RECIPES = ("wanda-channels",)
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


# -------------------------------------------------------------------------------------------- models


def resolve_dtype(device: str, dtype: str) -> str:
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimkit.primitives.files.atomic import staging_dir

    start = time.perf_counter()
    torch_dtype = getattr(torch, dtype)
    config = shape.config(dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.tie_weights()
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


# ---------------------------------------------------------------------------------------------- runs


def target_of(shape: Shape, recipe: str) -> str:
    """What the 20% is of: the whole model for the real shapes; the decoder layers for the synthetic ones
    (sweeps, tiny), whose 49,152-word embeddings are a large part of them (20% of a tiny model would be most
    of its layers), so every sweep point removes the same fraction of every layer. SP3's projection narrows
    the embeddings with the layers, so it takes 20% of the model everywhere (its solver needs ``of: model``)."""
    return "model" if REAL.get(shape.name) == shape or recipe.startswith("sp3") else "layers"


VARIANT_SEPARATOR = "@"
"""``--recipes`` takes ``NAME@KEY=VALUE[@KEY=VALUE...]``: the bundled NAME with ``slimkit --set`` overrides."""


def split_variant(recipe: str) -> tuple[str, list[str]]:
    """``"sp3-llm@stages.1.args.learning_rate=0"`` -> ``("sp3-llm", ["stages.1.args.learning_rate=0"])``."""
    name, *overrides = recipe.split(VARIANT_SEPARATOR)
    return name, overrides


def variant_raw(recipe: str) -> dict[str, Any]:
    """The bundled recipe of ``recipe``'s name, parsed, with its overrides applied as ``slimkit recipe run --set``
    would (keys address the recipe as written: stage indices before any stage is dropped)."""
    from slimkit.recipes.loading import apply_override, parse_yaml, recipe_path

    name, overrides = split_variant(recipe)
    path = recipe_path(name)
    raw = parse_yaml(path.read_text(), str(path))
    for assignment in overrides:
        apply_override(raw, assignment)
    return raw


def scale_recipe(recipe: str, samples: int, seq_len: int, of: str = "model") -> tuple[dict[str, Any], list[str]]:
    """The bundled ``recipe`` (with a variant's overrides) for a cost run: 20% of ``of``, not strict, the
    calibration budget, without its recovery stages (:data:`RECOVERY_STAGES`, at the top level or inside
    ``sequential``). The cost run's target and calibration replace what an override set there."""
    raw = variant_raw(recipe)
    raw["target"] = {**(raw.get("target") or {}), "ratio": RATIO, "of": of, "strict": False}
    calibration = dict(raw.get("calibration") or {})
    calibration.update(samples=samples, seq_len=seq_len)
    calibration["batch_size"] = min(int(calibration.get("batch_size") or samples), samples)
    raw["calibration"] = calibration
    if of == "layers":  # LoRAP's layer ratio is defined from the whole model: the same 20% of every layer instead
        for item in raw["stages"]:
            for child in item.get("sequential", []) if isinstance(item, dict) else []:
                child_args = child.setdefault("args", {})
                if child_args.get("ratio_rule") == "layer" or (
                    child["stage"] == "lowrank" and "ratio" not in child_args
                ):
                    child_args.pop("ratio_rule", None)
                    child_args["ratio"] = RATIO
    dropped: list[str] = []

    def kept(items: list[Any]) -> list[Any]:
        out = []
        for item in items:
            if isinstance(item, dict) and item.get("stage") in RECOVERY_STAGES:
                dropped.append(item["stage"])
            elif isinstance(item, dict) and "sequential" in item:
                out.append({**item, "sequential": kept(item["sequential"])})
            else:
                out.append(item)
        return out

    raw["stages"] = kept(raw["stages"])
    return raw, dropped


def _rss_parts(pid: int) -> dict[str, int]:
    """``RssAnon`` / ``RssFile`` / ``RssShmem`` of a process in kB (Linux ``/proc``; empty elsewhere)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    parts = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            parts[key] = int(value.split()[0])
    return parts


def sample_memory(
    process: subprocess.Popen, every_s: float = 0.2, deadline: float | None = None
) -> dict[str, float | None]:
    """Wait for ``process``, sampling its descendants' resident memory: the peak of anonymous memory (what
    a memory budget controls) and of file-backed pages (memory-mapped weights: page cache the kernel can
    drop, yet counted in ``ru_maxrss``, the report's peak RSS). Sampled, so a peak shorter than
    ``every_s`` can be missed; None where ``/proc`` is unavailable. Past ``deadline`` (a ``time.perf_counter``
    value) the process group is killed and ``timed_out`` is set."""
    import psutil

    anon = file = 0
    seen = False
    cpu: dict[str, float] = {}
    while not _ended(process, cpu):
        if deadline is not None and time.perf_counter() > deadline:
            stop_group(process, cpu)
            sampled = {"peak_anon_mb": anon / 1024, "peak_file_mb": file / 1024} if seen else {}
            return {"peak_anon_mb": None, "peak_file_mb": None, **sampled, **cpu, "timed_out": True}
        try:
            pids = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        except psutil.Error:
            pids = []
        parts = [_rss_parts(pid) for pid in pids]
        if any(parts):
            seen = True
            anon = max(anon, sum(p.get("RssAnon", 0) + p.get("RssShmem", 0) for p in parts))
            file = max(file, sum(p.get("RssFile", 0) for p in parts))
        time.sleep(every_s)
    if not seen:
        return {"peak_anon_mb": None, "peak_file_mb": None, **cpu}
    return {"peak_anon_mb": anon / 1024, "peak_file_mb": file / 1024, **cpu}


def _ended(process: subprocess.Popen, cpu: dict[str, float]) -> bool:
    """Whether ``process`` ended (reaped without blocking); when it did, ``cpu["cpu_s"]`` is its CPU seconds with
    its waited-for descendants' (``wait4``: this process's own, whatever other runs end beside it)."""
    if not hasattr(os, "wait4") or process.returncode is not None:
        return process.poll() is not None
    try:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere
        return process.poll() is not None
    if pid == 0:
        return False
    process.returncode = os.waitstatus_to_exitcode(status)
    cpu["cpu_s"] = usage.ru_utime + usage.ru_stime
    return True


def stop_group(process: subprocess.Popen, cpu: dict[str, float] | None = None) -> None:
    """Kill a run started in its own session (the launcher and the run it started) and reap it; ``cpu`` gets its
    CPU seconds as :func:`sample_memory` records them."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while not _ended(process, {} if cpu is None else cpu):
        time.sleep(0.02)


OOM_MARKERS = ("OutOfMemoryError", "out of memory", "MemoryError")


def out_of_memory(log_text: str) -> bool:
    """Whether a failed run's output says it ran out of memory (CUDA or host)."""
    return any(marker in log_text for marker in OOM_MARKERS)


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _killed(returncode: int) -> bool:
    return returncode in (-9, 137, 247)  # SIGKILL: directly, through a shell, or through the launcher's sys.exit


def run_one(
    shape: Shape,
    sweeps: list[str],
    folder: Path,
    recipe: str,
    args: argparse.Namespace,
    dtype: str,
    scratch: Path,
    max_memory: str | None = None,
    timeout_s: float | None = None,
    live: set[subprocess.Popen] | None = None,
) -> dict[str, Any]:
    """One compression run in its own process; the row (status ok, or failed / oom / timeout with the reason).
    ``timeout_s``: the run is killed after this many seconds (a ``--budget-s`` that would be overrun); ``live``:
    the process is in it while it runs (so the caller can stop it)."""
    import yaml

    of = target_of(shape, recipe)
    raw, dropped = scale_recipe(recipe, args.samples, args.seq_len, of)
    weights = shape.params()["total"] * _dtype_bytes(dtype)
    row: dict[str, Any] = {
        "id": f"{shape.name}/{recipe}" + ("@offload" if max_memory else ""),
        "shape": shape.name,
        "kind": sweeps[0],
        "sweeps": sweeps,
        "recipe": recipe,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "intermediate": shape.intermediate,
        "family": shape.family,
        "weights_mb": weights / 2**20,
        "layer_params": shape.params()["layers"],
        "of": of,
        "dropped_stages": dropped,
        "max_memory": max_memory,
        "status": "ok",
    }
    name = split_variant(recipe)[0]
    work = Path(tempfile.mkdtemp(prefix=f"{shape.name}-{name}-", dir=scratch))
    try:
        recipe_file = work / f"{name}.yaml"
        recipe_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        out = work / "run"
        command = [sys.executable, "-m", "slimkit.cli.main", "recipe", "run", str(recipe_file), "--out", str(out)]
        command += ["--model", str(folder), "--device", args.device, "--dtype", dtype, "--no-eval", "--force"]
        if max_memory:
            command += ["--max-memory", max_memory]
        log_path = work / "run.log"
        start, cpu_before = time.perf_counter(), _children_cpu_s()
        with log_path.open("w") as handle:
            handle.write(shlex.join(command) + "\n")
            handle.flush()
            env = {**os.environ, **OFFLINE_ENV, **QUIET_ENV, "TMPDIR": str(work)}
            if args.threads is not None:
                env |= {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            process = subprocess.Popen(
                via_launcher(command), stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            if live is not None:
                live.add(process)
            try:
                sampled = sample_memory(process, deadline=None if timeout_s is None else start + timeout_s)
            finally:
                if live is not None:
                    live.discard(process)
        done = process
        row["process_wall_s"] = time.perf_counter() - start
        timed_out = bool(sampled.pop("timed_out", False))
        cpu_s = sampled.pop("cpu_s", None)
        row.update(sampled)
        # CPU seconds of the whole process (imports and load included): less sensitive than wall time to
        # other processes on the same cores; the 1-minute load average says how busy the machine was
        row["process_cpu_s"] = cpu_s if cpu_s is not None else _children_cpu_s() - cpu_before
        row["load_average_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        if timed_out:
            reason = f"not finished within {timeout_s:.0f} s (what was left of --budget-s); last output: "
            return {**row, "status": "timeout", "reason": (reason + last_line(log_path))[:400]}
        if done.returncode != 0:
            reason = last_line(log_path)
            status = "oom" if out_of_memory(log_path.read_text(errors="replace")) else "failed"
            if _killed(done.returncode):
                status, reason = "oom", "killed (SIGKILL): out of memory on this machine"
            return {**row, "status": status, "reason": f"exit {done.returncode}: {reason}"[:400]}
        report = json.loads((out / "report.json").read_text())
    finally:
        discard(work)
    stages = {k: v for k, v in (report.get("timings_s") or {}).get("stages", {}).items() if not k.startswith("eval:")}
    compress = sum(v for k, v in stages.items() if k == "calibration" or k[:1].isdigit())
    placement = report.get("placement") or {}
    params = report.get("params") or {}
    row.update(
        {
            "stages_s": stages,
            "load_s": stages.get("load"),
            "calibration_s": stages.get("calibration"),
            "save_s": stages.get("save"),
            "compress_s": compress,
            "s_per_layer": compress / shape.layers,
            "total_s": (report.get("timings_s") or {}).get("total"),
            "peak_rss_mb": report.get("peak_rss_mb"),
            "peak_gpu_mb": placement.get("peak_gpu_mb"),
            "offloaded": placement.get("offloaded"),
            "device": placement.get("device"),
            "dtype": placement.get("dtype"),
            "params_before": params.get("before"),
            "params_after": params.get("after"),
            "achieved": (report.get("target") or {}).get("achieved"),
            "target_met": (report.get("target") or {}).get("met"),
            "calibration": report.get("calibration"),
            "notes": report.get("notes", []),
        }
    )
    return row


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


# ------------------------------------------------------------------------------------------- fitting


def fit_power(xs: list[float], ys: list[float]) -> dict[str, Any] | None:
    """Least squares on logs, ``y = c * x^exponent``; None with fewer than two distinct positive points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y is not None and y > 0]
    if len(points) < 2 or len({p[0] for p in points}) < 2:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((p[1] - my) ** 2 for p in points)
    ss_res = sum((p[1] - intercept - slope * p[0]) ** 2 for p in points)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"exponent": slope, "coefficient": math.exp(intercept), "r2": r2, "points": n}


FITS = (
    # (sweep kind, x: row key or callable name, label)
    ("depth", "layers", "layers"),
    ("width", "hidden", "hidden"),
    ("real", "layer_params", "layer params"),
)
COSTS = (("compress_s", "compression s"), ("peak_rss_above_baseline_mb", "peak RSS above baseline"))


def _sweeps(row: dict[str, Any]) -> list[str]:
    """The fits a row takes part in: its sweeps (a shape can be in both the depth and the width sweep)."""
    return row.get("sweeps") or [row["kind"]]


def exponents(rows: list[dict[str, Any]], recipes: list[str]) -> list[dict[str, Any]]:
    found = []
    for recipe in recipes:
        for kind, key, label in FITS:
            chosen = [r for r in rows if r["recipe"] == recipe and kind in _sweeps(r) and r["status"] == "ok"]
            for cost, cost_label in COSTS:
                fit = fit_power([r[key] for r in chosen], [r.get(cost) for r in chosen])
                found.append(
                    {
                        "recipe": recipe,
                        "sweep": kind,
                        "x": label,
                        "cost": cost_label,
                        "cost_key": cost,
                        **(fit or {"exponent": None, "r2": None, "points": len(chosen)}),
                    }
                )
    return found


# -------------------------------------------------------------------------------------------- output


def _num(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _gb(mb: float | None) -> str:
    return "-" if mb is None else f"{mb / 1024:.2f}"


def _concurrent(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows come from a ``--jobs`` run (each says which rows ran beside it)."""
    return any("beside" in r for r in rows)


def run_cell(row: dict[str, Any]) -> str:
    """How a row ran: alone, beside N other rows (its times are not comparable with a row run alone), or alone
    again after it ran short of memory beside others."""
    first = row.get("rerun_of")
    if first is not None:
        return f"alone (again, after {first.get('status')} beside {len(first.get('beside') or [])})"
    beside = row.get("beside") or []
    return f"beside {len(beside)}" if beside else "alone"


def _rows_table(rows: list[dict[str, Any]], gpu: bool) -> list[str]:
    concurrent = _concurrent(rows)
    head = "| shape | recipe" + (" | run" if concurrent else "") + " | layers | hidden | params | weights GiB "
    head += "| load s | calib s | stage s | save s "
    head += "| compress s | s/layer | peak RSS GiB | above baseline GiB" + (" | peak GPU GiB" if gpu else "")
    extra = any(r.get("load_average_1m") is not None for r in rows)
    head += " | achieved | per stage s |" + (" process CPU s | load 1m |" if extra else "")
    lines = [head, "|" + " --- |" * (2 + concurrent) + " ---: |" * (head.count("|") - 3 - concurrent)]
    for r in rows:
        run = [run_cell(r)] if concurrent else []
        if r["status"] != "ok":
            cells = [r["shape"], f"`{r['recipe']}`", *run, str(r["layers"]), str(r["hidden"]), "-"]
            cells.append(_gb(r["weights_mb"]))
            lines.append("| " + " | ".join(cells) + f" | **{r['status']}**: {r.get('reason', '')} |")
            continue
        stage = sum(v for k, v in r["stages_s"].items() if k[:1].isdigit())
        cells = [
            r["shape"],
            f"`{r['recipe']}`",
            *run,
            str(r["layers"]),
            str(r["hidden"]),
            f"{r['params_before'] / 1e6:,.0f}M",
            _gb(r["weights_mb"]),
            _num(r["load_s"]),
            _num(r["calibration_s"]),
            _num(stage),
            _num(r["save_s"]),
            _num(r["compress_s"]),
            _num(r["s_per_layer"]),
            _gb(r["peak_rss_mb"]),
            _gb(r.get("peak_rss_above_baseline_mb")),
            *([_gb(r["peak_gpu_mb"])] if gpu else []),
            "-" if r["achieved"] is None else f"{r['achieved']:.2%}" + ("" if r["target_met"] else " (missed)"),
            ", ".join(f"{k} {_num(v)}" for k, v in r["stages_s"].items() if k[:1].isdigit()) or "-",
            *([_num(r.get("process_cpu_s")), _num(r.get("load_average_1m"), 2)] if extra else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _concurrency_lines(concurrency: dict[str, Any] | None) -> list[str]:
    if not concurrency:
        return []
    known = ", ".join(f"`{Path(p).name}`" for p in concurrency.get("known_peaks") or [])
    rule = f"max(memory plan, peak measured in {known})" if known else "memory plan"
    return [
        f"- `--jobs {concurrency['jobs']}`: rows ran as concurrent processes, a row starting when the running rows' "
        f"expected peaks plus its own fit in {concurrency['capacity_gib']:.1f} GiB ({concurrency['memory_fraction']:g} "
        f"of {concurrency['device_gib']:.1f}) and their saved models on the scratch disk; expected peak = {rule} x "
        f"{concurrency['plan_margin']:g} + {concurrency['process_gib']:g} GiB. Column 'run': **times of a row run "
        "beside others are not comparable with a row run alone** (they shared the device and the cores); peak "
        "memory is each process's own; a row short of memory beside others ran again alone at the end"
    ]


def markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    rows = result["rows"]
    gpu = any(r.get("peak_gpu_mb") for r in rows)
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [
        f"# Compression cost vs model size ({result['date']})",
        "",
        f"**{STATEMENT}**",
        "",
        f"Command: `{result['command']}`",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.1f} GiB RAM, torch threads "
        f"{m['torch_threads']}; load average at start {m.get('load_average_start')}, at end "
        f"{m.get('load_average_end')} (other processes share the cores: compare rows of this file, prefer ratios)",
        f"- versions: {versions}; python {m['python']}",
        f"- device: {s['device']} ({result.get('device_name') or 'CPU'}), dtype {s['dtype']}",
        f"- runs: target 20% of the model's parameters (`target.strict: false`), calibration {s['samples']} x "
        f"{s['seq_len']} tokens of C4, each recipe's recovery stages ({', '.join(sorted(RECOVERY_STAGES))}) dropped, "
        "`--no-eval`; "
        "one process per row, so peak RSS is that run's own",
        "- compress s = calibration + the recipe's stages (load and save listed apart); s/layer = compress s / "
        "decoder layers; above baseline = peak RSS minus the baseline row (a 2-layer tiny model: the process "
        "itself)",
        *_concurrency_lines(s.get("concurrency")),
        f"- wall time of the whole benchmark: {result.get('wall_s', 0) + result.get('resumed_wall_s', 0):.0f} s "
        f"over {1 + bool(result.get('resumed_wall_s'))} invocation(s) (model building "
        f"{result.get('build_s', 0):.0f} s of it)",
        "",
    ]
    base = result.get("baseline") or {}
    if base:
        lines += [
            f"Baseline: {base.get('id')} peak RSS {_gb(base.get('peak_rss_mb'))} GiB "
            f"({'ok' if base.get('status') == 'ok' else base.get('reason')}).",
            "",
        ]
    for kind, title in (("real", "Real shapes"), ("depth", "Depth sweep"), ("width", "Width sweep")):
        order = {name: i for i, name in enumerate(result["settings"]["recipes"])}
        chosen = sorted(
            (r for r in rows if kind in _sweeps(r)),
            key=lambda r: (order.get(r["recipe"], len(order)), r.get("layer_params") or 0, r["layers"]),
        )
        if chosen:
            lines += [f"## {title}", "", *_rows_table(chosen, gpu), ""]
    fits = result.get("exponents") or []
    if fits:
        lines += [
            "## Growth exponents",
            "",
            "Least squares on logs, `cost = c * x^e`; depth: layers at SmolLM2-135M's width; width: hidden size "
            "at a fixed depth (MLP 8/3 x hidden); real: the real shapes against their decoder-layer parameters "
            "(embeddings excluded). R^2 of the fit in brackets; '-' where fewer than two rows ran.",
            "",
            "| recipe | cost | e(layers) | e(hidden) | e(layer params) |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for recipe in result["settings"]["recipes"]:
            for _cost, cost_label in COSTS:
                cells = []
                for kind, _key, _label in FITS:
                    fit = next(
                        (f for f in fits if f["recipe"] == recipe and f["sweep"] == kind and f["cost"] == cost_label),
                        None,
                    )
                    if fit is None or fit["exponent"] is None:
                        cells.append("-")
                    else:
                        cells.append(f"{fit['exponent']:.2f} ({fit['r2']:.2f}, n={fit['points']})")
                lines.append(f"| `{recipe}` | {cost_label} | " + " | ".join(cells) + " |")
        lines.append("")
    offload = [r for r in rows if r["kind"] == "offload"]
    if offload:
        lines += [
            "## Offload: weights larger than the memory budget",
            "",
            "`--max-memory` below the weights' size: accelerate keeps the embeddings, head and the layers that fit "
            "within the budget in memory and the rest on disk (CPU) or in CPU memory (CUDA); layer stages load one "
            "layer at a time. Peak RSS (`ru_maxrss`, the report's number) also counts file-backed pages: the "
            "memory-mapped offloaded weights each layer is read from, page cache the kernel can drop under "
            "pressure. The budget is about anonymous memory (sampled every 0.2 s from /proc): it holds when peak "
            "anonymous memory minus the baseline's stays near the budget plus one layer and its calibration "
            "activations, well below the weights.",
            "",
            "| shape | recipe"
            + (" | run" if _concurrent(offload) else "")
            + " | weights GiB | budget | baseline RSS GiB | peak RSS GiB | above baseline GiB"
            + " | peak anon GiB (baseline) | peak file-backed GiB"
            + (" | peak GPU GiB" if gpu else "")
            + " | offloaded | load s | compress s | save s | achieved |",
            "| --- | --- |"
            + (" --- |" if _concurrent(offload) else "")
            + " ---: |" * (11 + (1 if gpu else 0))
            + " --- |",
        ]
        for r in offload:
            recipe = f"`{r['recipe']}`" + (f" | {run_cell(r)}" if _concurrent(offload) else "")
            if r["status"] != "ok":
                lines.append(
                    f"| {r['shape']} | {recipe} | {_gb(r['weights_mb'])} | {r['max_memory']} | "
                    f"{_gb(base.get('peak_rss_mb'))} | **{r['status']}**: {r.get('reason', '')} |"
                )
                continue
            lines.append(
                f"| {r['shape']} | {recipe} | {_gb(r['weights_mb'])} | {r['max_memory']} | "
                f"{_gb(base.get('peak_rss_mb'))} | {_gb(r['peak_rss_mb'])} | {_gb(r.get('peak_rss_above_baseline_mb'))}"
                + f" | {_gb(r.get('peak_anon_mb'))} ({_gb(base.get('peak_anon_mb'))}) | {_gb(r.get('peak_file_mb'))}"
                + (f" | {_gb(r['peak_gpu_mb'])}" if gpu else "")
                + f" | {r['offloaded']} | {_num(r['load_s'])} | {_num(r['compress_s'])} | {_num(r['save_s'])} | "
                f"{'-' if r['achieved'] is None else format(r['achieved'], '.2%')} |"
            )
        lines.append("")
    if result.get("analysis"):  # written by people after the run (kept in the json, rendered with --render)
        lines += ["## Reading these numbers", "", *(f"- {a}" for a in result["analysis"]), ""]
    if result.get("cuts"):
        lines += ["## Left out", "", *(f"- {c}" for c in result["cuts"]), ""]
    notes = sorted({n for r in rows for n in r.get("notes", []) if "calibration and perplexity" not in n})
    if notes:
        lines += ["## Notes from the runs", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def write_result(result: dict[str, Any], base: Path) -> None:
    tmp = base.parent / f".{base.name}.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, base.with_suffix(".json"))
    base.with_suffix(".md").write_text(markdown(result))


# ---------------------------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise BenchError(message)


def _names(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    from slimkit.primitives.datasets.data_paths import cache_root

    parser = _Parser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        help=f"comma-separated real shapes (default CPU: {','.join(CPU_REAL)}; "
        f"CUDA adds llama-3.2-3b,llama-3.1-8b); known: {','.join(REAL)}; or wW-LL, a tiny llama (e.g. w64-L4)",
    )
    parser.add_argument(
        "--recipes",
        help=f"comma-separated recipes (default {','.join(RECIPES)}); 'all': every bundled causal-LM recipe (with "
        "the other entries after them); "
        "NAME@KEY=VALUE[@KEY=VALUE...]: a bundled recipe with --set overrides (e.g. "
        "sp3-llm@stages.1.args.learning_rate=0), a row of its own",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (CPU float32, CUDA bf16)")
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of each run (default: torch's)")
    parser.add_argument("--samples", type=int, default=8, help="calibration samples (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="calibration sequence length (default 128)")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the depth and width sweeps")
    parser.add_argument("--offload-shape", default=None, help=f"shape of the offload rows (default {OFFLOAD_SHAPE})")
    parser.add_argument(
        "--offload-memory",
        default=None,
        help=f"their --max-memory (default {OFFLOAD_MEMORY}); 'none' skips the offload rows",
    )
    parser.add_argument("--skip", help="comma-separated shape/recipe rows not to run (e.g. qwen2.5-1.5b/llm-pruner)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no run after this many seconds (the rest are listed as cut); runs go cheapest first",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="rows run at the same time, admitted by expected peak memory (default 1: one at a time)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=MEMORY_FRACTION,
        help=f"with --jobs: the running rows' expected peaks sum to at most this share of the device's memory "
        f"(default {MEMORY_FRACTION})",
    )
    parser.add_argument(
        "--known-peaks",
        type=Path,
        nargs="+",
        action="extend",
        default=[],
        help="with --jobs: earlier results .json files whose measured peak GPU memory a row expects when above its "
        "memory plan",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (the smoke test)")
    parser.add_argument("--no-baseline", action="store_true", help="no baseline row (peak RSS above it is not shown)")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="tokenizer folder saved with the models (default smollm2-135m's)"
    )
    parser.add_argument("--models-dir", type=Path, default=cache_root() / "scale-models", help="saved models")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default benchmarks/results)")
    parser.add_argument(
        "--resume", action="store_true", help="keep the ok rows of today's results file of this name; run the rest"
    )
    parser.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="as --resume, from this results .json (e.g. an earlier day's); the results go under today's name",
    )
    parser.add_argument("--note", action="append", default=[], help="a line for the results' 'Left out' list")
    parser.add_argument("--render", type=Path, default=None, help="only write the .md of this results .json")
    parser.add_argument("--name", default=None, help="results are OUT/<date>-<name>.*; default 'scale' / 'scale-quick'")
    return parser


def plan(args: argparse.Namespace) -> tuple[list[tuple[Shape, list[str]]], list[str], tuple[Shape, str] | None]:
    recipes = _names(args.recipes) or list(QUICK_RECIPES if args.quick else RECIPES)
    from slimkit.recipes.loading import bundled_recipes

    if "all" in recipes:  # every causal-LM recipe, then the other entries (variants) not already among them
        recipes = list(dict.fromkeys([*llm_recipes(), *(r for r in recipes if r != "all")]))

    unknown = [r for r in recipes if split_variant(r)[0] not in bundled_recipes()]
    if unknown:
        raise BenchError(f"--recipes: unknown recipe(s) {', '.join(unknown)}")
    from slimkit.primitives.errors import SlimkitError

    for recipe in recipes:
        try:
            variant_raw(recipe)
        except SlimkitError as error:
            raise BenchError(f"--recipes: {recipe}: {error}") from None
    if args.samples < 1 or args.seq_len < 8:
        raise BenchError("--samples must be at least 1 and --seq-len at least 8")
    if args.jobs < 1:
        raise BenchError(f"--jobs must be at least 1, got {args.jobs}")
    if not 0 < args.memory_fraction <= 1:
        raise BenchError(f"--memory-fraction must be above 0 and at most 1, got {args.memory_fraction}")
    for path in args.known_peaks:
        read_json_file(path, "--known-peaks")
    if args.resume_from is not None:
        read_json_file(args.resume_from, "--resume-from")
    cuda = args.device.startswith("cuda")
    configs = _names(args.configs)
    if configs is None:
        configs = [] if args.quick else list(GPU_REAL if cuda else CPU_REAL)
    bad = [c for c in configs if c not in REAL and synthetic_shape(c) is None]
    if bad:
        raise BenchError(
            f"--configs: unknown shape(s) {', '.join(bad)}; known: {', '.join(REAL)}, or wW-LL (hidden W a multiple "
            "of 64, L layers, e.g. w64-L4)"
        )
    shapes = [(REAL.get(c) or synthetic_shape(c), ["real"]) for c in configs]
    if not args.no_sweeps:
        shapes += sweep_shapes(args.quick)
    offload = None
    if (args.offload_memory or "").lower() != "none":
        from slimkit.primitives.device.placement import parse_size

        if args.offload_shape:
            if args.offload_shape not in REAL:
                raise BenchError(f"--offload-shape: unknown shape {args.offload_shape}; known: {', '.join(REAL)}")
            shape = REAL[args.offload_shape]
        else:
            shape = width_shape(QUICK_WIDTHS[-1], QUICK_DEPTHS[0], kind="width") if args.quick else REAL[OFFLOAD_SHAPE]
        memory = args.offload_memory or (half_the_layers(shape, args) if args.quick else OFFLOAD_MEMORY)
        parse_size(memory)
        offload = (shape, memory)
    check_folder_option("--out", args.out, "the results")
    check_folder_option("--models-dir", args.models_dir, "the saved scale models")
    return shapes, recipes, offload


_RECIPE_WEIGHT = {"lorap": 3.0, "llm-pruner": 1.0, "wanda-channels": 0.6, "sp3-oneshot": 0.4}
_STAGE_WEIGHT = {
    "prune": 0.5,
    "prune_layer": 0.6,
    "pca_project": 0.4,
    "lowrank": 2.4,
    "reconstruct": 3.0,
    "obs_prune_layer": 2.0,
    "cce": 6.0,
    "prunenet": 8.0,
    "mask_train": 10.0,
}
"""Rough relative stage costs (from the four measured recipes above and the stage times of an 8B run; see
docs/methods/benchmark-harness.md), for ordering only; a gradient scorer doubles prune."""


def recipe_weight(recipe: str) -> float:
    """A recipe's relative cost: the measured factor of the four base recipes, else the sum of its stages'."""
    if recipe in _RECIPE_WEIGHT:
        return _RECIPE_WEIGHT[recipe]
    stages = variant_raw(recipe).get("stages") or []
    flat = [c for s in stages if isinstance(s, dict) for c in (s.get("sequential") or [s])]
    weight = 0.0
    for stage in flat:
        if stage.get("stage") in RECOVERY_STAGES:
            continue
        own = _STAGE_WEIGHT.get(stage.get("stage"), 1.0)
        scorer = str((stage.get("args") or {}).get("scorer", ""))
        weight += own * (2.0 if "taylor" in scorer or "coupled" in scorer else 1.0)
    return weight or 1.0


def estimated_cost(shape: Shape, recipe: str, offloaded: bool) -> float:
    """A rough relative cost for ordering (decoder-layer parameters x a per-recipe factor)."""
    return shape.params()["layers"] * recipe_weight(recipe) * (1.5 if offloaded else 1.0)


def llm_recipes() -> list[str]:
    """Every bundled recipe for a causal LM (``--recipes all``): the encoder (GLUE) recipes left out."""
    from slimkit.primitives.io.model_sources import SOURCES
    from slimkit.recipes.loading import bundled_recipes, parse_yaml

    found = []
    for name, path in sorted(bundled_recipes().items()):
        model = parse_yaml(path.read_text(), str(path)).get("model")
        source = SOURCES.get(model if isinstance(model, str) else (model or {}).get("source", ""))
        if source is None or source.task == "causal-lm":
            found.append(name)
    return found


def synthetic_shape(name: str) -> Shape | None:
    """``wW-LL`` (e.g. ``w64-L4``): a llama shape of hidden W and L layers (:func:`width_shape`), for smoke tests."""
    import re

    match = re.fullmatch(r"w(\d+)-L(\d+)", name)
    if match is None or int(match[1]) < 64 or int(match[1]) % 64 or int(match[2]) < 1:
        return None
    return width_shape(int(match[1]), int(match[2]), kind="real")


def half_the_layers(shape: Shape, args: argparse.Namespace) -> str:
    """A budget of the embeddings and half the decoder layers (the quick offload row's)."""
    params = shape.params()
    size = _dtype_bytes(resolve_dtype(args.device, args.dtype))
    resident = (params["total"] - params["layers"]) * size
    return f"{(resident + params['layers'] * size // 2) // 1024}KiB"


MIN_ROW_S = 15.0
"""A row is not started with less of ``--budget-s`` left (starting the process and loading take about that)."""


def skipped_row(shape: Shape, sweeps: list[str], recipe: str, memory: str | None, dtype: str) -> dict[str, Any]:
    row = {"id": f"{shape.name}/{recipe}" + ("@offload" if memory else ""), "shape": shape.name}
    row |= {"kind": sweeps[0], "sweeps": sweeps, "recipe": recipe, "layers": shape.layers, "hidden": shape.hidden}
    return row | {"weights_mb": shape.params()["total"] * _dtype_bytes(dtype) / 2**20, "status": "skipped"}


@dataclass
class Queued:
    """A row waiting to start: what it runs, what it reserves beside others (``--jobs``), and for a row run again
    alone, its first attempt."""

    shape: Shape
    sweeps: list[str]
    recipe: str
    memory: str | None
    label: str
    demand: Demand = field(default_factory=lambda: Demand(0.0))
    planned: float | None = None
    first: dict[str, Any] | None = None
    beside: set[str] = field(default_factory=set)
    waiting: str | None = None

    @property
    def row_id(self) -> str:
        return f"{self.shape.name}/{self.recipe}" + ("@offload" if self.memory else "")

    @property
    def reserved(self) -> Demand:
        """What it holds while it runs: a re-run holds the whole device (nothing starts beside it)."""
        return self.demand if self.first is None else Demand(math.inf, self.demand.disk)


def planned_peak(
    shape: Shape, recipe: str, args: argparse.Namespace, dtype: str, max_memory: str | None
) -> float | None:
    """Bytes a run needs on its device by the recipe's memory plan (``slimkit.engine.memory_check``, the check
    ``slimkit recipe run`` refuses with before loading), from the shape's config alone: the weights plus the largest
    stage, or for an offloaded run its ``--max-memory`` plus the largest stage; None when no plan can be made."""
    import torch

    from slimkit.engine.memory_check import recipe_memory_plan
    from slimkit.primitives.device.placement import parse_size
    from slimkit.recipes.loading import validate

    raw, _dropped = scale_recipe(recipe, args.samples, args.seq_len, target_of(shape, recipe))
    try:
        plan = recipe_memory_plan(validate(raw, recipe), shape.config(dtype), getattr(torch, dtype))
    except Exception as error:  # no plan: the row runs alone (it reports its own refusal if the recipe is bad)
        log(f"  {shape.name}/{recipe}: no memory plan ({type(error).__name__}: {error}); it runs alone")
        return None
    if max_memory:
        return parse_size(max_memory) + plan.peak - plan.weights
    return float(plan.peak)


def known_peaks(paths: list[Path]) -> dict[tuple[str, str | None, str], float]:
    """The largest peak GPU memory (bytes) measured per (row id, --max-memory, dtype) in earlier results files."""
    found: dict[tuple[str, str | None, str], float] = {}
    for path in paths:
        result = read_json_file(path, "--known-peaks")
        dtype = str((result.get("settings") or {}).get("dtype"))
        for row in result.get("rows") or []:
            if isinstance(row, dict) and row.get("status") == "ok" and row.get("peak_gpu_mb"):
                key = (str(row.get("id")), row.get("max_memory"), dtype)
                found[key] = max(found.get(key, 0.0), float(row["peak_gpu_mb"]) * 2**20)
    return found


def device_bytes(device: str) -> int:
    """Memory of the runs' device: the GPU's total, or the machine's RAM for the CPU."""
    import torch

    where = build_device(device)
    if where.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(where)).total_memory
    import psutil

    return psutil.virtual_memory().total


def admit_rows(
    queue: list[Queued], args: argparse.Namespace, dtype: str, result: dict[str, Any]
) -> tuple[float, float]:
    """Set each queued row's demand for ``--jobs``: expected peak (:func:`benchmarks.scale_jobs.expected_peak` of
    its plan and the largest peak ``--known-peaks`` measured for it) and its saved model's size on the scratch disk
    (at most the dense weights); record the settings used; the bytes the running rows may use together and
    the device's memory."""
    known = known_peaks(args.known_peaks)
    total = device_bytes(args.device)
    capacity = total * args.memory_fraction
    for entry in queue:
        entry.planned = planned_peak(entry.shape, entry.recipe, args, dtype, entry.memory)
        measured = known.get((entry.row_id, entry.memory, dtype))
        weights = entry.shape.params()["total"] * _dtype_bytes(dtype)
        entry.demand = Demand(expected_peak(entry.planned, measured, total), float(weights))
    result["settings"]["concurrency"] = {
        "jobs": args.jobs,
        "memory_fraction": args.memory_fraction,
        "device_gib": total / 2**30,
        "capacity_gib": capacity / 2**30,
        "plan_margin": PLAN_MARGIN,
        "process_gib": PROCESS_BYTES / 2**30,
        "known_peaks": [str(p) for p in args.known_peaks],
    }
    return capacity, total


def _disk_free(folder: Path) -> float:
    """Bytes the running rows may still write under ``folder`` beside a new one: the file system's free bytes plus
    what the rows already wrote there (each running row's reservation counts its whole saved model)."""
    import shutil

    written = 0
    for parent, _dirs, files in os.walk(folder):
        for name in files:
            try:
                written += os.lstat(os.path.join(parent, name)).st_blocks * 512
            except OSError:  # removed meanwhile by its run
                pass
    return float(shutil.disk_usage(folder).free + written)


def _mb(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else value / 2**20


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch

    from slimkit.primitives.device.placement import parse_size
    from slimkit.primitives.io import versions

    shapes, recipes, offload = plan(args)
    dtype = resolve_dtype(args.device, args.dtype)
    skip = set(_names(args.skip) or [])
    name = args.name or ("scale-quick" if args.quick else "scale")
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"{dt.date.today().isoformat()}-{name}"
    start = time.perf_counter()
    result: dict[str, Any] = {
        "name": name,
        "date": dt.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.scale", *argv]),
        "statement": STATEMENT,
        "machine": machine_info(),
        "versions": versions(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "build_device": build_device(args.device),
        "settings": {
            "device": args.device,
            "dtype": dtype,
            "samples": args.samples,
            "seq_len": args.seq_len,
            "ratio": RATIO,
            "recipes": recipes,
            "shapes": [asdict(s) | {"sweeps": sweeps} for s, sweeps in shapes],
            "offload": None if offload is None else {"shape": offload[0].name, "max_memory": offload[1]},
            "quick": args.quick,
            "budget_s": args.budget_s,
        },
        "rows": [],
        "exponents": [],
        "cuts": [*args.note, *(f"skipped by --skip: {r}" for r in sorted(skip))],
        "build_s": 0.0,
    }
    args.models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slimkit-scale-") as scratch_name:
        scratch = Path(scratch_name)

        def folder_of(shape: Shape) -> Path:
            folder, seconds = model_folder(shape, dtype, args.models_dir, build_device(args.device), args.tokenizer)
            if seconds is not None:
                result["build_s"] += seconds
                result.setdefault("built", []).append({"shape": shape.name, "seconds": seconds})
                log(f"  built {shape.name} ({dtype}) on {build_device(args.device)} in {seconds:.0f} s -> {folder}")
            return folder

        def record(row: dict[str, Any]) -> None:
            baseline = (result.get("baseline") or {}).get("peak_rss_mb")
            if row.get("peak_rss_mb") is not None and baseline is not None:
                row["peak_rss_above_baseline_mb"] = max(row["peak_rss_mb"] - baseline, 0.0)
            result["rows"].append(row)
            result["wall_s"] = time.perf_counter() - start
            result["exponents"] = exponents(result["rows"], recipes)
            write_result(result, base)
            if row["status"] == "ok":
                log(
                    f"  {row['id']}: compress {row['compress_s']:.1f} s, load {row['load_s']:.1f} s, "
                    f"peak RSS {row['peak_rss_mb']:.0f} MB, achieved {row['achieved']:.2%}"
                )
            else:
                log(f"  {row['id']}: {row['status']}: {row.get('reason')}")

        source = args.resume_from or (base.with_suffix(".json") if args.resume else None)
        previous = read_json_file(source, "--resume-from") if source is not None and source.is_file() else {}
        kept = {r["id"]: r for r in previous.get("rows", []) if r.get("status") == "ok"}
        if kept:
            log(f"--resume: keeping {len(kept)} rows of {source}")
            result["resumed_from"] = str(source)
            result["rows"] += list(kept.values())
            result["build_s"] += previous.get("build_s") or 0.0
            result["resumed_wall_s"] = (previous.get("resumed_wall_s") or 0.0) + (previous.get("wall_s") or 0.0)
            result["cuts"] = [*previous.get("cuts", []), *result["cuts"]]
            result["machine"]["load_average_start"] = (previous.get("machine") or {}).get("load_average_start")
        # the baseline: a run of a tiny model (the process itself); in --quick the smallest sweep shape's
        # wanda-channels run, used again as that sweep row (one process fewer in the smoke test)
        base_shape = width_shape(QUICK_WIDTHS[0], QUICK_DEPTHS[0], kind="depth") if args.quick else BASELINE
        if args.no_baseline:
            baseline = {"status": "not run"}
        elif (previous.get("baseline") or {}).get("status") == "ok":
            baseline = previous["baseline"]
        else:
            log(f"baseline ({base_shape.name}, wanda-channels)")
            baseline = run_one(base_shape, ["baseline"], folder_of(base_shape), "wanda-channels", args, dtype, scratch)
        result["baseline"] = baseline
        jobs = [(s, sweeps, r, None) for s, sweeps in shapes for r in recipes]
        if offload is not None:
            shape, memory = offload
            weights = shape.params()["total"] * _dtype_bytes(dtype)
            if weights <= parse_size(memory):
                result["cuts"].append(f"offload rows: {shape.name}'s weights fit in {memory}; nothing to offload")
            else:
                jobs += [(shape, ["offload"], r, memory) for r in OFFLOAD_RECIPES if r in recipes]
        if not args.quick:  # offload rows first (the budget claim), then cheapest first: a --budget-s cut drops
            # the most expensive runs
            jobs.sort(key=lambda job: (job[3] is None, estimated_cost(job[0], job[2], job[3] is not None)))
        log(f"{len(jobs)} runs on {args.device} ({dtype}); results {base}.*")
        if args.jobs > 1:
            log(f"--jobs {args.jobs}: run folders in {scratch} ({_disk_free(scratch) / 2**30:.1f} GiB free)")
        queue: list[Queued] = []
        for index, (shape, sweeps, recipe, memory) in enumerate(jobs, 1):
            row_id = f"{shape.name}/{recipe}"
            if row_id in skip or row_id + ("@offload" if memory else "") in kept:
                continue
            queue.append(Queued(shape, sweeps, recipe, memory, f"[{index}/{len(jobs)}] {row_id}"))
        if args.jobs > 1:
            capacity, device_total = admit_rows(queue, args, dtype, result)
        else:  # one row at a time: nothing is ever beside a row, so no demand is needed
            capacity = device_total = 0.0
        running: dict[str, Queued] = {}
        finished: queue_module.Queue[tuple[str, dict[str, Any]]] = queue_module.Queue()
        live: set[subprocess.Popen] = set()

        def start_row(entry: Queued, folder: Path, timeout_s: float | None) -> None:
            def work() -> None:
                try:
                    row = run_one(
                        entry.shape,
                        entry.sweeps,
                        folder,
                        entry.recipe,
                        args,
                        dtype,
                        scratch,
                        entry.memory,
                        timeout_s=timeout_s,
                        live=live,
                    )
                except Exception as error:  # a crash of the harness itself is that row's result, not a hang
                    row = {
                        **skipped_row(entry.shape, entry.sweeps, entry.recipe, entry.memory, dtype),
                        "status": "failed",
                        "reason": f"{type(error).__name__}: {error}"[:400],
                    }
                finished.put((entry.row_id, row))

            for other in running.values():
                other.beside.add(entry.row_id)
                entry.beside.add(other.row_id)
            running[entry.row_id] = entry
            threading.Thread(target=work, daemon=True).start()

        try:
            while queue or running:
                while queue:
                    entry = queue[0]
                    shape, sweeps, recipe, memory = entry.shape, entry.sweeps, entry.recipe, entry.memory
                    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
                    if left is not None and left < MIN_ROW_S:
                        queue.pop(0)
                        reason = (
                            f"not run: {max(left, 0):.0f} s of --budget-s {args.budget_s:.0f} s left (runs go "
                            "cheapest first by an estimate from the layers' size and the recipe's stages)"
                        )
                        if entry.first is not None:  # a re-run that no longer fits the budget: the first attempt
                            record(
                                entry.first
                                | {
                                    "reason": f"{entry.first.get('reason')} (beside other rows; "
                                    f"not run again alone: {reason})"[:600]
                                }
                            )
                        else:
                            record({**skipped_row(shape, sweeps, recipe, memory, dtype), "reason": reason})
                        continue
                    others = [e.reserved for e in running.values()]
                    wait = blocked_by(entry.reserved, others, capacity, _disk_free(scratch), args.jobs)
                    if wait is not None:
                        if wait != entry.waiting:
                            log(f"{entry.label} waits: {wait}")
                            entry.waiting = wait
                        break
                    queue.pop(0)
                    log(
                        entry.label
                        + (f" with --max-memory {memory}" if memory else "")
                        + (f" (beside {len(running)} running)" if running else "")
                        + (" (again, alone)" if entry.first is not None else "")
                    )
                    try:
                        folder = folder_of(shape)
                    except Exception as error:  # a shape that cannot be built is a row, not a crash
                        row = {"id": entry.row_id, "shape": shape.name, "kind": sweeps[0], "sweeps": sweeps}
                        row |= {"recipe": recipe, "layers": shape.layers, "hidden": shape.hidden, "status": "failed"}
                        row |= {"weights_mb": shape.params()["total"] * _dtype_bytes(dtype) / 2**20}
                        row |= {"max_memory": memory}
                        record({**row, "reason": f"building the model: {type(error).__name__}: {error}"[:400]})
                        continue
                    if (shape, recipe, memory) == (base_shape, "wanda-channels", None) and baseline["status"] == "ok":
                        record({**baseline, "kind": sweeps[0], "sweeps": sweeps, "baseline_run": True})
                        continue
                    left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
                    start_row(entry, folder, left)
                if not running:
                    continue
                key, row = finished.get()
                entry = running.pop(key)
                if args.jobs > 1:
                    row |= {"beside": sorted(entry.beside), "expected_peak_mb": _mb(entry.demand.memory)}
                    row["planned_peak_mb"] = _mb(entry.planned)
                    if entry.first is not None:
                        row["rerun_of"] = {k: entry.first.get(k) for k in ("status", "reason", "beside")}
                if rerun_alone(row, device_total):
                    log(f"  {row['id']}: {row['status']} beside {', '.join(row['beside'])}: run again alone at the end")
                    queue.append(replace(entry, first=row, beside=set()))
                    continue
                record(row)
        finally:
            for process in list(live):  # an interrupted benchmark leaves no run behind
                stop_group(process)
    result["wall_s"] = time.perf_counter() - start
    result["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result["exponents"] = exponents(result["rows"], recipes)
    write_result(result, base)
    log(f"wrote {base}.json, {base}.md in {result['wall_s']:.0f} s")
    return result


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # a SIGTERM (``timeout``) ends as Ctrl-C does: running rows stopped, results kept


def _main(argv: list[str]) -> None:
    import signal

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        args = build_parser().parse_args(argv)
        if args.render is not None:  # the markdown again from a results file (e.g. after a change to the tables)
            result = read_json_file(args.render, "--render")
            args.render.with_suffix(".md").write_text(markdown(result))
            return
        run(args, argv)
    finally:  # the handler is the benchmark's only while it runs (main() may be called in a longer process)
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, _main)


if __name__ == "__main__":
    sys.exit(main())
