"""Calibration token batches: N samples of L tokens from a named corpus, reproducible by seed.

Stream corpora (wikitext2, ptb) give N random windows of the tokenised text. Document corpora
(c4, alpaca) follow the SparseGPT/Wanda C4 loader: draw a random document, redraw while it has
fewer than L tokens, then take a random L-token window of it. Documents are tokenised lazily so a
small calibration set does not tokenise the whole corpus.

GLUE datasets (``glue-sst2``, ``glue-mrpc``, ``glue-rte``, ``glue-stsb``) pack ``examples`` training
examples of the task (SP3 section 4.1: 512) into one stream and draw non-overlapping windows of it;
see :func:`slimkit.primitives.datasets.gluedata.calibration_ids`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from slimkit.primitives.datasets import gluedata, textdata
from slimkit.primitives.errors import SlimkitError


@dataclass(frozen=True)
class CalibrationSpec:
    dataset: str = "c4"
    samples: int = 32
    seq_len: int = 128
    seed: int = 0
    split: str | None = None
    examples: int | None = None
    """GLUE datasets only: training examples packed before the windows are drawn (None: 512)."""

    def describe(self) -> dict:
        record = {**asdict(self), "tokens": self.samples * self.seq_len}
        if self.examples is None:
            record.pop("examples")
        return record


def _stream_windows(ids: torch.Tensor, spec: CalibrationSpec, generator: torch.Generator) -> torch.Tensor:
    if ids.numel() <= spec.seq_len:
        raise SlimkitError(f"dataset '{spec.dataset}' has only {ids.numel()} tokens, fewer than seq_len={spec.seq_len}")
    starts = torch.randint(0, ids.numel() - spec.seq_len, (spec.samples,), generator=generator)
    return torch.stack([ids[s : s + spec.seq_len] for s in starts.tolist()])


def _document_windows(docs: tuple[str, ...], tokenizer, spec: CalibrationSpec, generator: torch.Generator):
    rows: list[torch.Tensor] = []
    attempts = 0
    while len(rows) < spec.samples:
        attempts += 1
        if attempts > 50 * spec.samples:
            raise SlimkitError(
                f"dataset '{spec.dataset}': too few documents with at least seq_len={spec.seq_len} tokens"
            )
        doc = docs[int(torch.randint(0, len(docs), (1,), generator=generator))]
        ids = tokenizer(doc, return_tensors="pt", add_special_tokens=False).input_ids[0]
        if ids.numel() <= spec.seq_len:
            continue
        start = int(torch.randint(0, ids.numel() - spec.seq_len, (1,), generator=generator))
        rows.append(ids[start : start + spec.seq_len])
    return torch.stack(rows)


def check_calibration_source(dataset: str) -> None:
    """Read ``dataset``'s file now (a GLUE task's train split, or a corpus), so a missing one, or an unusable cache
    folder the datasets library writes to, fails before any compute."""
    from slimkit.primitives.datasets.data_paths import cache_root

    task = gluedata.calibration_task(dataset)
    if task is not None:
        gluedata.read_split(task, "train")
        return
    cache_root()  # usable: checked even when the corpus was read earlier in this process
    textdata.documents(dataset)


def calibration_batches(tokenizer, spec: CalibrationSpec) -> torch.Tensor:
    """Token ids ``[samples, seq_len]`` drawn from ``spec.dataset`` with ``spec.seed``."""
    if spec.samples < 1 or spec.seq_len < 2:
        raise SlimkitError(f"calibration needs samples >= 1 and seq_len >= 2 (got {spec.samples}, {spec.seq_len})")
    task = gluedata.calibration_task(spec.dataset)
    if task is not None:
        examples = spec.examples or 512
        return gluedata.calibration_ids(
            tokenizer, task, spec.samples, spec.seq_len, spec.seed, examples, spec.split or "train"
        )
    generator = torch.Generator().manual_seed(spec.seed)
    corpus = textdata.corpus(spec.dataset)
    docs = textdata.documents(spec.dataset, spec.split)
    if corpus.kind == "stream":
        ids = tokenizer(docs[0], return_tensors="pt", add_special_tokens=False).input_ids[0]
        return _stream_windows(ids, spec, generator)
    return _document_windows(docs, tokenizer, spec, generator)
