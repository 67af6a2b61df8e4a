"""The offline teacher: its top-k logits per token, computed once per token window and cached on disk, reused by
every later run that trains on the same windows from the same teacher (another budget, a resumed run, another
student).

* :func:`teacher_fingerprint`: the teacher folder's content key (as the dense comparison's cache keys it).
* :class:`TopKCache`: ``folder/<fingerprint>/<k>/<sha256 of the windows' ids>.pt``: one micro-batch's top-k logits
  and int32 token ids, written atomically, checked when read (a damaged entry is computed again, with a note); the
  teacher is loaded only on the first miss.
* :func:`topk_kl`: KL(teacher || student) over the teacher's top-k tokens at temperature T, times T**2 (k =
  vocabulary size gives the full KL).

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slimkit.primitives.device.moves import to_input_device
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files.atomic import staging_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
ENTRY_OVERHEAD = 1 << 20
"""Bytes an entry may hold beyond its tensors' (the ``torch.save`` container); a larger file is not read."""


def teacher_fingerprint(folder: str | Path) -> str:
    """The key of the teacher's cached logits: its folder's content key (every file's SHA-256; large files' digests
    remembered by their stamp, :func:`~slimkit.primitives.evaluate.reference.remembered_digest`)."""
    from slimkit.primitives.evaluate.reference import content_key

    root = Path(folder)
    if not any(p.is_file() and p.suffix in WEIGHT_SUFFIXES for p in root.iterdir()):
        raise SlimkitError(f"offline teacher: {root} holds no weight file to key its cached logits by")
    return content_key(root)


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


def entry_problem(saved: object, shape: tuple[int, ...], k: int, vocab: int | None) -> str | None:
    """Why a cache entry read back is not the top-``k`` logits of a micro-batch of ``shape`` (None: it is): a dict of
    ``values`` (floating, finite) and ``indices`` (int32, each below ``vocab`` when known) of
    ``[*shape, k]`` (``k`` at most the vocabulary)."""
    if not isinstance(saved, dict) or not all(
        isinstance(saved.get(key), torch.Tensor) for key in ("values", "indices")
    ):
        return "it is not a dict of values and indices tensors"
    values, indices = saved["values"], saved["indices"]
    wanted = min(k, vocab) if vocab is not None else k
    if tuple(values.shape) != (*shape, wanted) or tuple(indices.shape) != (*shape, wanted):
        return f"shapes {list(values.shape)} and {list(indices.shape)}, not {[*shape, wanted]} (another k or windows)"
    if not values.is_floating_point() or not bool(torch.isfinite(values).all()):
        return "its logits are not finite floating-point numbers"
    if indices.dtype != torch.int32:
        return f"its token ids are {indices.dtype}, not int32"
    if indices.numel() and (int(indices.min()) < 0 or (vocab is not None and int(indices.max()) >= vocab)):
        return f"token ids from {int(indices.min())} to {int(indices.max())}, outside the vocabulary of {vocab}"
    return None


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
    damaged: list[str] = field(default_factory=list)
    """``"<entry>: <why>"`` for each entry that could not be used and was computed again."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise SlimkitError(f"offline teacher: top_k must be at least 1 (got {self.k})")

    def path_of(self, ids: torch.Tensor) -> Path:
        key = hashlib.sha256(ids.to(torch.int64).contiguous().cpu().numpy().tobytes())
        key.update(str(tuple(ids.shape)).encode())
        return self.folder / self.fingerprint / str(self.k) / f"{key.hexdigest()[:40]}.pt"

    def _read(self, path: Path, ids: torch.Tensor, vocab: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The entry at ``path`` when it is usable; None when there is none (or it is not a plain file: left as it
        is), with the reason in :attr:`damaged` when there was one."""
        try:
            status = path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            self.damaged.append(f"{path}: cannot read it ({error.strerror or error})")
            return None
        if not stat.S_ISREG(status.st_mode):
            self.damaged.append(f"{path}: not a regular file")
            return None
        limit = ids.numel() * self.k * 16 + ENTRY_OVERHEAD
        if status.st_size > limit:
            self.damaged.append(f"{path}: {status.st_size:,} bytes, more than an entry of this size holds")
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated or foreign file: whatever torch.load raises
            self.damaged.append(f"{path}: not a readable entry ({type(error).__name__})")
            return None
        problem = entry_problem(saved, tuple(ids.shape), self.k, vocab)
        if problem is not None:
            self.damaged.append(f"{path}: {problem}")
            return None
        return saved["values"], saved["indices"]

    def topk(self, ids: torch.Tensor, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` ``[b, s, k]`` of the teacher's logits on ``ids`` (read from the cache, or computed
        with the teacher, loaded on the first miss, and written). ``vocab``: the vocabulary size the entry's token
        ids must stay below (the student's), checked when an entry is read; a damaged entry is computed again."""
        path = self.path_of(ids)
        cached = self._read(path, ids, vocab)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        if self.teacher is None:
            self.teacher = self.load_teacher()
            self.teacher.eval()
            self.teacher.requires_grad_(False)
        with torch.no_grad():
            logits = self.teacher(input_ids=to_input_device(self.teacher, ids), use_cache=False).logits
            values, indices = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
        values, indices = values.cpu(), indices.to(torch.int32).cpu()
        if os.path.lexists(path) and not stat.S_ISREG(path.lstat().st_mode):
            return values, indices  # a planted link, FIFO or folder is left alone (and not written through)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_file(path)
        try:
            torch.save({"values": values, "indices": indices}, staging)
            os.replace(staging, path)
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        return values, indices

    def note(self, label: str) -> str | None:
        """One line for the report when entries were damaged (None otherwise)."""
        if not self.damaged:
            return None
        count = len(self.damaged)
        return (
            f"{label}: {count} cached teacher entr{'y was' if count == 1 else 'ies were'} unusable and computed again "
            f"(first: {self.damaged[0]})"
        )

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
        logits = model(input_ids=ids, use_cache=False).logits
        values, indices = self.cache.topk(ids, logits.shape[-1])
        device = logits.device
        counted = mask.to(device)
        loss = topk_kl(logits, values.to(device), indices.to(device), self.temperature, counted)
        return loss * counted.sum()


__all__ = ["TopKCache", "TopKDistillationObjective", "entry_problem", "teacher_fingerprint", "topk_kl"]
