"""Measured latency per candidate: what replacing one layer's sub-block adds to (or saves from) the prefill and the
per-token decode time of the runtime the model will be served in (PyTorch on its device, or llama.cpp through GGUF).

A candidate is timed on a *probe*: the model with its shape in every layer but the first, timed whole, alternating
with the dense model, ``added = (T_probe - T_dense) / changed`` (each the fastest of its samples); a choice's
latency is the additive estimate ``T_dense + sum added``.
A table is kept per model shape, runtime, settings and machine (:func:`table_key`), or given as JSON.

Method note: docs/methods/search.md.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from slimkit.primitives.arch import ModelView
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.search.build import BuildSettings, reshape, timing_structure
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.digest import settings_key

Runtime = Literal["pytorch", "llama.cpp"]
RUNTIMES: tuple[Runtime, ...] = ("pytorch", "llama.cpp")
Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class LatencySettings:
    """How the runtime is timed (part of the table's key)."""

    runtime: Runtime = "pytorch"
    context: int = 128
    """Prompt tokens of the timed prefill."""
    new_tokens: int = 32
    """Greedy tokens of the timed decode."""
    batch: int = 1
    """Sequences at once (PyTorch; llama.cpp is timed at batch 1)."""
    repeats: int = 3
    """Timed runs of each model (the median is kept)."""
    threads: int | None = None
    """llama.cpp's threads (None: every core)."""


@dataclass
class LatencyTable:
    """The dense model's seconds per phase and each candidate's per-layer seconds added, by ``part/name``."""

    runtime: str
    dense: dict[str, float]
    added: dict[str, dict[str, float]]
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def cost(self, spec: CandidateSpec, phase: str) -> float:
        """Seconds ``spec`` adds to one layer's ``phase`` (0 for the parent)."""
        if spec.kind == "dense":
            return 0.0
        key = f"{spec.part}/{spec.name}"
        if key not in self.added or phase not in self.added[key]:
            raise SlimkitError(f"latency table ({self.runtime}): no measured {phase} time for {key}")
        return self.added[key][phase]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "latency table") -> LatencyTable:
        """A table written by :meth:`to_json` (or by hand); one line naming what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as error:
            raise SlimkitError(f"{where}: not JSON ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("runtime"), str):
            raise SlimkitError(f"{where}: needs an object with runtime, dense and added")
        dense, added = data.get("dense"), data.get("added")
        if not isinstance(dense, dict) or not all(_seconds(dense.get(p), positive=True) for p in PHASES):
            raise SlimkitError(f"{where}: dense needs positive seconds for {' and '.join(PHASES)}")
        if not isinstance(added, dict) or not all(
            isinstance(v, dict) and all(_seconds(v.get(p)) for p in PHASES) for v in added.values()
        ):
            raise SlimkitError(f"{where}: added needs, per part/candidate, finite seconds for {' and '.join(PHASES)}")
        return cls(
            str(data["runtime"]),
            {p: float(dense[p]) for p in PHASES},
            {str(k): {p: float(v[p]) for p in PHASES} for k, v in added.items()},
            dict(data.get("settings") or {}),
            [str(n) for n in data.get("notes") or []],
        )


def _seconds(value: object, positive: bool = False) -> bool:
    if type(value) not in (int, float) or not math.isfinite(float(value)):  # type: ignore[arg-type]
        return False
    return float(value) > 0 if positive else True  # type: ignore[arg-type]


def machine() -> dict[str, str]:
    """What a timing depends on besides the model: the host, its processor, the libraries, the GPU."""
    found = {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    try:
        import llama_cpp

        found["llama_cpp"] = str(llama_cpp.__version__)
    except ImportError:
        pass
    found["cpus"] = str(os.cpu_count())
    return found


def table_key(model: nn.Module, specs: Sequence[CandidateSpec], settings: LatencySettings) -> str:
    """The key a measured table is kept under: the model's config, the candidates, the settings, the machine."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    names = sorted(f"{s.part}/{s.name}" for s in specs)
    return settings_key({"config": config, "specs": names, "settings": asdict(settings), "machine": machine()})


def probe(model: nn.Module, spec: CandidateSpec, settings: BuildSettings) -> tuple[nn.Module, int]:
    """A copy of ``model`` with ``spec``'s shape in every layer but the first (a GGUF whose first layer has no
    attention gets a placeholder head), and how many layers changed."""
    copied = copy.deepcopy(model)
    changed = list(range(1, ModelView(copied).num_layers)) or [0]
    for index in changed:
        reshape(copied, index, spec, timing_structure(copied, index, spec, settings))
    return copied, len(changed)


class Timing(Protocol):
    """A runtime's timing session: a model loaded once, then timed one sample at a time."""

    def load(self, model: nn.Module) -> Any: ...

    def sample(self, handle: Any) -> dict[str, float]:
        """Seconds of one prefill of the context and of one decoded token (its mean over the new tokens)."""
        ...

    def close(self, handle: Any) -> None: ...


@dataclass
class PytorchTiming:
    """Models timed in PyTorch on their own device (:func:`~slimkit.primitives.evaluate.speed.throughput`)."""

    vocab_size: int
    settings: LatencySettings

    def load(self, model: nn.Module) -> Any:
        return model

    def sample(self, handle: Any) -> dict[str, float]:
        from slimkit.primitives.evaluate.speed import throughput

        s = self.settings
        result = throughput(handle, self.vocab_size, s.batch, s.context, s.new_tokens, repeats=1)
        return {
            "prefill": s.batch * s.context / result.prefill_tokens_per_s,
            "decode": s.batch / result.decode_tokens_per_s,
        }

    def close(self, handle: Any) -> None:
        return None


@dataclass
class LlamacppTiming:
    """Models exported to GGUF (float16) and timed in llama.cpp on the CPU, batch 1."""

    tokenizer: Any
    settings: LatencySettings

    def load(self, model: nn.Module) -> Any:
        from slimkit.primitives.evaluate.llamacpp import load_gguf
        from slimkit.primitives.export.gguf_file import write_gguf

        folder = tempfile.TemporaryDirectory(prefix="slimkit-latency-")
        path = Path(folder.name) / "probe.gguf"
        write_gguf(model, self.tokenizer, path, type="f16")
        s = self.settings
        return load_gguf(path, s.context + s.new_tokens, threads=s.threads), folder

    def sample(self, handle: Any) -> dict[str, float]:
        from slimkit.primitives.evaluate.llamacpp import gguf_throughput

        s = self.settings
        result = gguf_throughput(handle[0], s.context, s.new_tokens, s.threads, repeats=1)
        return {"prefill": s.context / result["prefill_tokens_per_s"], "decode": 1.0 / result["decode_tokens_per_s"]}

    def close(self, handle: Any) -> None:
        handle[0].close()
        handle[1].cleanup()


def fastest(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per phase, the least seconds of ``samples`` (the run other work disturbed least)."""
    return {phase: min(sample[phase] for sample in samples) for phase in PHASES}


def measure_table(
    model: nn.Module, specs: Sequence[CandidateSpec], settings: LatencySettings, timing: Timing, build: BuildSettings
) -> LatencyTable:
    """Each distinct candidate's per-layer seconds added in ``timing``'s runtime (see the module docstring): each
    probe timed ``settings.repeats`` times, alternating with the dense model, the fastest of each kept, so a probe
    and the dense model it is compared with are timed in the same minutes."""
    dense_handle = timing.load(model)
    added: dict[str, dict[str, float]] = {}
    dense_samples: list[dict[str, float]] = []
    try:
        for spec in sorted({s for s in specs if s.kind != "dense"}):
            key = f"{spec.part}/{spec.name}"
            if spec.kind == "lowrank" and settings.runtime == "llama.cpp":
                added[key] = dict.fromkeys(PHASES, 0.0)
                continue
            probed, changed = probe(model, spec, build)
            handle = timing.load(probed)
            del probed
            here: list[dict[str, float]] = []
            seconds: list[dict[str, float]] = []
            try:
                for _ in range(settings.repeats):
                    here.append(timing.sample(dense_handle))
                    seconds.append(timing.sample(handle))
            finally:
                timing.close(handle)
            near, probe_best = fastest(here), fastest(seconds)
            added[key] = {phase: (probe_best[phase] - near[phase]) / changed for phase in PHASES}
            dense_samples += here
        dense_samples.append(timing.sample(dense_handle))
    finally:
        timing.close(dense_handle)
    dense = fastest(dense_samples)
    notes = [
        f"dense {phase}: fastest {dense[phase]:.4g} s of {len(dense_samples)} samples, median "
        f"{statistics.median(sample[phase] for sample in dense_samples):.4g} s"
        for phase in PHASES
    ]
    if settings.runtime == "llama.cpp" and any(s.kind == "lowrank" for s in specs):
        notes.append("low-rank candidates are merged back to dense weights in GGUF: 0 added, not measured")
    return LatencyTable(settings.runtime, dense, added, asdict(settings), notes)


__all__ = [
    "PHASES",
    "RUNTIMES",
    "LatencySettings",
    "LatencyTable",
    "LlamacppTiming",
    "Phase",
    "PytorchTiming",
    "Runtime",
    "Timing",
    "fastest",
    "machine",
    "measure_table",
    "probe",
    "table_key",
]
