"""GLUE tasks from the shipped TSV files: examples, tokenised batches, calibration windows.

Tasks come from ``data/glue`` (see its SOURCE.md), each with train and dev splits.

Method note: docs/methods/glue.md.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache

import torch

from slimkit.primitives.datasets.data_paths import data_file
from slimkit.primitives.errors import SlimkitError

SPLITS = ("train", "dev")
CALIBRATION_PREFIX = "glue-"


@dataclass(frozen=True)
class GlueTask:
    name: str
    folder: str
    text_columns: tuple[str, ...]
    label_column: str
    label_names: tuple[str, ...]
    """Class names by label index; empty for the regression task (STS-B)."""
    metrics: tuple[str, ...]
    """Metric names :func:`slimkit.primitives.evaluate.glue_metrics.evaluate_glue` reports, main metric first."""

    @property
    def num_labels(self) -> int:
        return len(self.label_names) or 1

    @property
    def regression(self) -> bool:
        return not self.label_names

    @property
    def pair(self) -> bool:
        return len(self.text_columns) == 2


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("sst2", "SST-2", ("sentence",), "label", ("negative", "positive"), ("accuracy",)),
        GlueTask(
            "mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", ("not_equivalent", "equivalent"), ("accuracy", "f1")
        ),
        GlueTask("rte", "RTE", ("sentence1", "sentence2"), "label", ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), "score", (), ("spearman", "pearson")),
    )
}


@dataclass(frozen=True)
class GlueExample:
    text_a: str
    text_b: str | None
    label: int | float


def glue_task(name: str) -> GlueTask:
    if name not in GLUE_TASKS:
        raise SlimkitError(f"unknown GLUE task '{name}'; allowed: {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[name]


def calibration_task(dataset: str) -> str | None:
    """The GLUE task of a calibration dataset name ``glue-<task>``; None for other datasets."""
    if not dataset.startswith(CALIBRATION_PREFIX):
        return None
    return glue_task(dataset.removeprefix(CALIBRATION_PREFIX)).name


def _read_tsv(relative: str) -> list[list[str]]:
    path = data_file(relative)
    with path.open(encoding="utf-8-sig", newline="") as handle:
        return [row for row in csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE) if row]


def _rows(relative: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a GLUE file; every row must have the header's column count."""
    rows = _read_tsv(relative)
    if not rows:
        raise SlimkitError(f"GLUE file {relative} is empty")
    header, body = rows[0], rows[1:]
    for number, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise SlimkitError(f"GLUE file {relative} line {number}: {len(row)} columns, the header has {len(header)}")
    return header, body


def _mrpc_train_rows() -> tuple[list[str], list[list[str]]]:
    header, body = _rows("glue/MRPC/msr_paraphrase_train.txt")
    held_out = {(row[0], row[1]) for row in _read_tsv("glue/MRPC/dev_ids.tsv")}
    first, second = header.index("#1 ID"), header.index("#2 ID")
    return header, [r for r in body if (r[first], r[second]) not in held_out]


def _label(task: GlueTask, value: str, where: str) -> int | float:
    try:
        if task.regression:
            return float(value)
        if value in task.label_names:
            return task.label_names.index(value)
        label = int(value)
    except ValueError:
        label = -1
    if not 0 <= label < task.num_labels:
        raise SlimkitError(f"{where}: bad label '{value}' for {task.name}")
    return label


@cache
def read_split(task: str, split: str) -> tuple[GlueExample, ...]:
    """Every example of ``task``'s ``split`` (``train`` or ``dev``) in file order."""
    spec = glue_task(task)
    if split not in SPLITS:
        raise SlimkitError(f"GLUE {task}: unknown split '{split}'; allowed: {', '.join(SPLITS)}")
    relative = f"glue/{spec.folder}/{split}.tsv"
    header, body = _mrpc_train_rows() if (task == "mrpc" and split == "train") else _rows(relative)
    missing = [c for c in (*spec.text_columns, spec.label_column) if c not in header]
    if missing:
        raise SlimkitError(f"GLUE {task} {split}: columns {missing} not in the header {header}")
    columns = [header.index(c) for c in spec.text_columns]
    label_column = header.index(spec.label_column)
    return tuple(
        GlueExample(
            text_a=row[columns[0]],
            text_b=row[columns[1]] if spec.pair else None,
            label=_label(spec, row[label_column], f"GLUE {task} {split} row {number}"),
        )
        for number, row in enumerate(body, start=1)
    )


def load_examples(task: str, split: str, count: int | None = None, seed: int | None = None) -> list[GlueExample]:
    """``count`` examples of a split: the first ones without ``seed``, a seeded draw with it (all if None)."""
    examples = read_split(task, split)
    if count is not None and count < 1:
        raise SlimkitError(f"GLUE {task} {split}: count must be >= 1 (got {count})")
    if seed is None:
        return list(examples[:count])
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(examples), generator=generator)[:count]
    return [examples[i] for i in order.tolist()]


def encode(tokenizer, examples: Sequence[GlueExample], max_length: int = 128) -> dict[str, torch.Tensor]:
    """A padded batch: the tokenizer's ``input_ids``, ``attention_mask`` (and ``token_type_ids``), ``labels``."""
    if tokenizer.pad_token is None:
        raise SlimkitError("GLUE batches need a tokenizer with a padding token")
    firsts = [e.text_a for e in examples]
    seconds = [e.text_b for e in examples] if examples and examples[0].text_b is not None else None
    batch = tokenizer(firsts, seconds, truncation=True, max_length=max_length, padding="longest", return_tensors="pt")
    labels = [e.label for e in examples]
    dtype = torch.float32 if any(isinstance(v, float) for v in labels) else torch.long
    keys = ("input_ids", "attention_mask", "token_type_ids")
    return {**{k: batch[k] for k in keys if k in batch}, "labels": torch.tensor(labels, dtype=dtype)}


def batches(
    tokenizer, examples: Sequence[GlueExample], batch_size: int, max_length: int = 128
) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive padded batches of ``examples`` in the given order (the last one may be smaller)."""
    for start in range(0, len(examples), batch_size):
        yield encode(tokenizer, examples[start : start + batch_size], max_length)


def training_order(size: int, seed: int, epoch: int) -> list[int]:
    """The example order of one training epoch: a permutation seeded by ``(seed, epoch)``."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(size, generator=generator).tolist()


def calibration_ids(
    tokenizer,
    task: str,
    samples: int,
    seq_len: int,
    seed: int,
    examples: int = 512,
    split: str = "train",
    max_length: int = 128,
) -> torch.Tensor:
    """``[samples, seq_len]`` token ids of packed ``task`` examples (see the module docstring)."""
    drawn = load_examples(task, split, min(examples, len(read_split(task, split))), seed)
    stream: list[int] = []
    for example in drawn:
        pair = (example.text_a,) if example.text_b is None else (example.text_a, example.text_b)
        stream.extend(tokenizer(*pair, truncation=True, max_length=max_length)["input_ids"])
    available = len(stream) // seq_len
    if available < samples:
        raise SlimkitError(
            f"calibration glue-{task}: {len(drawn)} examples give {len(stream)} tokens, {available} windows of "
            f"{seq_len}, fewer than samples={samples}; raise calibration.examples or lower samples / seq_len"
        )
    windows = torch.tensor(stream[: available * seq_len], dtype=torch.long).reshape(available, seq_len)
    generator = torch.Generator().manual_seed(seed)
    return windows[torch.randperm(available, generator=generator)[:samples]]
