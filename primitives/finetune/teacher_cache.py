"""The offline teacher: its top-k logits per token, computed once per token window and cached on disk, reused by
every later run that trains on the same windows from the same teacher (another budget, a resumed run, another
student).

* :func:`teacher_fingerprint`: a key of the teacher's weights by content, read cheaply: for each weight file (and
  ``config.json``) its name, size and its first and last MiB.
* :class:`TopKCache`: ``folder/<fingerprint>/<k>/<sha256 of the windows' ids>.pt`` holding the top-k logits
  (the teacher's dtype) and their token ids (int32) of one micro-batch; written atomically. The teacher itself is
  loaded only on the first miss (``load_teacher``), so a run whose windows are all cached never loads it.
* :func:`topk_kl`: KL(teacher || student) over the teacher's top-k tokens: the teacher's top-k logits renormalised at
  temperature T, the student's full log-softmax at T read at those tokens, times T**2 (the sparse distillation loss
  of offline-logit pipelines; k = vocabulary size gives the full KL).

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import staging_file

SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def teacher_fingerprint(folder: str | Path) -> str:
    """A hex key of the model folder's weights: names, sizes, and the first and last MiB of every weight file and of
    ``config.json`` (a changed file changes its header, size or ends)."""
    root = Path(folder)
    files = sorted(
        p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    )
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise SlimkitError(f"offline teacher: {root} holds no weight file to key its cached logits by")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(SAMPLE_BYTES))
            if size > SAMPLE_BYTES:
                handle.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def topk_kl(
    student_logits: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over counted tokens of KL(teacher's top-k || student) at ``temperature``, times its square.

    ``student_logits``: ``[b, s, vocab]``; ``values`` / ``indices``: the teacher's top-k logits and token ids
    ``[b, s, k]``; ``mask``: ``[b, s]`` (None: all)."""
    teacher_log_p = F.log_softmax(values.float() / temperature, dim=-1)
    student_log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
    student_at = student_log_p.gather(-1, indices.long().to(student_log_p.device))
    per_token = (teacher_log_p.exp() * (teacher_log_p - student_at)).sum(dim=-1)
    if mask is None:
        return per_token.mean() * temperature**2
    weight = mask.to(per_token.device, per_token.dtype)
    return (per_token * weight).sum() / weight.sum().clamp_min(1) * temperature**2


@dataclass
class TopKCache:
    """Top-k teacher logits per micro-batch, on disk under ``folder/<fingerprint>/<k>/``."""

    folder: Path
    fingerprint: str
    k: int
    load_teacher: Callable[[], nn.Module]
    teacher: nn.Module | None = None
    hits: int = 0
    misses: int = field(default=0)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise SlimkitError(f"offline teacher: top_k must be at least 1 (got {self.k})")

    def path_of(self, ids: torch.Tensor) -> Path:
        key = hashlib.sha256(ids.to(torch.int64).contiguous().cpu().numpy().tobytes())
        key.update(str(tuple(ids.shape)).encode())
        return self.folder / self.fingerprint / str(self.k) / f"{key.hexdigest()[:40]}.pt"

    def topk(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` ``[b, s, k]`` of the teacher's logits on ``ids`` (read from the cache, or computed
        with the teacher, loaded on the first miss, and written)."""
        path = self.path_of(ids)
        if path.is_file():
            self.hits += 1
            saved = torch.load(path, map_location="cpu", weights_only=True)
            return saved["values"], saved["indices"]
        self.misses += 1
        if self.teacher is None:
            self.teacher = self.load_teacher()
            self.teacher.eval()
            self.teacher.requires_grad_(False)
        with torch.no_grad():
            logits = self.teacher(input_ids=to_input_device(self.teacher, ids), use_cache=False).logits
            values, indices = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
        values, indices = values.cpu(), indices.to(torch.int32).cpu()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_file(path)
        try:
            torch.save({"values": values, "indices": indices}, staging)
            os.replace(staging, path)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        return values, indices

    def release(self) -> None:
        self.teacher = None


@dataclass
class TopKDistillationObjective:
    """The distillation objective of :mod:`slimkit.primitives.finetune.recovery` on cached top-k teacher logits."""

    cache: TopKCache
    temperature: float = 1.0

    def count(self, mask: torch.Tensor) -> int:
        return int(mask.sum())

    def loss_sum(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        values, indices = self.cache.topk(ids)
        logits = model(input_ids=ids, use_cache=False).logits
        device = logits.device
        counted = mask.to(device)
        loss = topk_kl(logits, values.to(device), indices.to(device), self.temperature, counted)
        return loss * counted.sum()


__all__ = ["TopKCache", "TopKDistillationObjective", "teacher_fingerprint", "topk_kl"]
