"""Packed token windows for recovery training, streamed from a named corpus or a local folder, and a token budget
cut into batches that train exactly the budget.

Method note: docs/methods/recovery-loop.md.
"""

from __future__ import annotations

import codecs
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from slimkit.primitives.datasets import textdata
from slimkit.primitives.errors import SlimkitError

FOLDER_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File endings a data folder may hold, and the ``datasets`` builder that reads each."""


@dataclass(frozen=True)
class TextSource:
    """Where training text comes from: a shipped corpus ``name``, or a local ``folder`` (which wins when given)."""

    name: str = "alpaca"
    folder: str | None = None
    seed: int = 0

    def describe(self) -> str:
        return f"folder {self.folder}" if self.folder else f"dataset {self.name}"


def folder_files(folder: str | Path) -> list[Path]:
    """The data files of ``folder`` (recursively, in name order); :class:`SlimkitError` when there is none or the
    folder is missing."""
    root = Path(folder)
    if not root.is_dir():
        raise SlimkitError(f"data folder {root} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in FOLDER_SUFFIXES)
    if not files:
        allowed = ", ".join(FOLDER_SUFFIXES)
        raise SlimkitError(f"data folder {root} holds no data file (allowed endings: {allowed})")
    return files


TEXT_PROBE_BYTES = 64 << 10
"""Bytes of a ``.txt`` file read to tell text from binary data."""


def _text_file_problem(path: Path) -> str | None:
    """Why ``path`` (a ``.txt`` data file) is not UTF-8 text, judged on its first :data:`TEXT_PROBE_BYTES`."""
    with path.open("rb") as handle:
        head = handle.read(TEXT_PROBE_BYTES)
    if b"\0" in head:
        return "holds binary data (a NUL byte), not text"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < TEXT_PROBE_BYTES)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text ({error.reason} at byte {error.start})"
    return None


def check_data_files(folder: str | Path) -> None:
    """Refuse, in one line and before any compute, a data folder a training stage could not read to its end: every
    data file must read as its ending says (``.txt``: UTF-8 text; ``.jsonl`` / ``.json`` / ``.parquet``: records
    whose first has a text field or instruction/output fields)."""
    import datasets

    datasets.disable_progress_bars()
    for path in folder_files(folder):
        builder = FOLDER_SUFFIXES[path.suffix]
        if builder == "text":
            problem = _text_file_problem(path)
            if problem is not None:
                raise SlimkitError(f"data file {path} {problem}; a .txt data file holds UTF-8 text")
            continue
        try:
            first = next(
                iter(datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)), None
            )
        except Exception as error:
            reason = " ".join(str(error).split())[:200]
            raise SlimkitError(
                f"cannot read data file {path} as {builder} ({type(error).__name__}: {reason})"
            ) from None
        if first is not None:
            record_text(first, str(path))


def count_windows(tokenizer, source: TextSource, seq_len: int, needed: int) -> int:
    """How many windows of ``seq_len`` tokens ``source`` gives, counted up to ``needed`` (the tokenizing stops
    there)."""
    count = 0
    for _window in packed_windows(tokenizer, source_documents(source), seq_len):
        count += 1
        if count >= needed:
            break
    return count


def check_windows(tokenizer, source: TextSource, seq_len: int, validation: int) -> None:
    """Refuse, in one line and before any compute, a source that cannot give its ``validation`` held-out windows of
    ``seq_len`` tokens and at least one window to train on."""
    found = count_windows(tokenizer, source, seq_len, validation + 1)
    if found <= validation:
        what = f"data_folder {source.folder}" if source.folder else f"dataset {source.name}"
        raise SlimkitError(
            f"{what} gives {found} window{'' if found == 1 else 's'} of {seq_len} tokens; training needs "
            f"{validation + 1} (validation_windows {validation} held out, then at least one to train on): add data, "
            "lower validation_windows or seq_len"
        )


def record_text(record: dict, where: str) -> str:
    """The text of one record: its ``text`` field, or an instruction / input / output record rendered as Alpaca."""
    if isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        return textdata.alpaca_text(record)
    raise SlimkitError(f"{where}: a record has neither a text field nor instruction/output fields")


def _folder_documents(folder: str) -> Iterator[str]:
    import datasets

    datasets.disable_progress_bars()
    for path in folder_files(folder):
        builder = FOLDER_SUFFIXES[path.suffix]
        extra = {"keep_linebreaks": True} if builder == "text" else {}
        try:
            records = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **extra)
            if builder == "text":  # one document per file: its lines joined again
                yield "".join(record["text"] for record in records)
                continue
            for record in records:
                yield record_text(record, str(path))
        except SlimkitError:
            raise
        except Exception as error:
            raise SlimkitError(f"cannot read data file {path}: {type(error).__name__}: {error}") from error


def source_documents(source: TextSource) -> Iterator[str]:
    """The documents of ``source`` in training order (a shipped corpus: shuffled once by ``source.seed``)."""
    if source.folder:
        yield from _folder_documents(source.folder)
        return
    docs = list(textdata.documents(source.name))
    random.Random(source.seed).shuffle(docs)
    yield from docs


def packed_windows(tokenizer, documents: Iterator[str], seq_len: int) -> Iterator[torch.Tensor]:
    """Windows of ``seq_len`` token ids (1-D ``long``) cut from the concatenated documents, each document followed
    by the tokenizer's end-of-text token (when it has one). The tail shorter than a window is dropped."""
    eos = tokenizer.eos_token_id
    buffer: list[int] = []
    for document in documents:
        buffer.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        if eos is not None:
            buffer.append(eos)
        while len(buffer) >= seq_len:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            del buffer[:seq_len]


def validation_windows(tokenizer, source: TextSource, seq_len: int, windows: int) -> torch.Tensor:
    """The ``windows`` held-out windows ``[windows, seq_len]`` (the first of the stream); refused when the source
    has fewer."""
    held: list[torch.Tensor] = []
    for window in packed_windows(tokenizer, source_documents(source), seq_len):
        if len(held) == windows:
            break
        held.append(window)
    if len(held) < windows:
        raise SlimkitError(
            f"{source.describe()} has {len(held)} windows of {seq_len} tokens; the validation set needs {windows} "
            "and training needs more after them"
        )
    return torch.stack(held) if held else torch.empty(0, seq_len, dtype=torch.long)


@dataclass(frozen=True)
class TokenBudget:
    """``tokens`` input tokens in steps of ``batch_size`` windows of ``seq_len`` tokens (the last step truncated)."""

    tokens: int
    batch_size: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise SlimkitError(
                f"token budget: tokens >= 1, batch_size >= 1 and seq_len >= 2 are needed (got tokens {self.tokens}, "
                f"batch_size {self.batch_size}, seq_len {self.seq_len})"
            )

    @property
    def step_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.step_tokens)

    def windows_of(self, step: int) -> int:
        """Windows the (0-based) ``step`` reads: ``batch_size``, fewer at the last step."""
        left = self.tokens - step * self.step_tokens
        return min(self.batch_size, math.ceil(left / self.seq_len))

    def mask_of(self, step: int) -> torch.Tensor:
        """The ``[windows, seq_len]`` mask of the tokens that count at ``step`` (all but the last step's tail)."""
        rows = self.windows_of(step)
        left = self.tokens - step * self.step_tokens
        counted = torch.arange(rows * self.seq_len).reshape(rows, self.seq_len) < left
        return counted


def training_windows(tokenizer, source: TextSource, seq_len: int, skip_validation: int) -> Iterator[torch.Tensor]:
    """The training windows without end: the stream after its first ``skip_validation`` windows, over and over."""
    while True:
        produced = 0
        for index, window in enumerate(packed_windows(tokenizer, source_documents(source), seq_len)):
            if index >= skip_validation:
                produced += 1
                yield window
        if produced == 0:
            raise SlimkitError(
                f"{source.describe()} has no training window of {seq_len} tokens after the {skip_validation} held "
                "out for validation"
            )


def budget_batches(
    tokenizer, source: TextSource, budget: TokenBudget, validation: int, start_step: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(step, ids [w, seq_len], mask [w, seq_len])`` for every step from ``start_step`` to the budget's end;
    the windows of the steps before ``start_step`` are skipped (resuming)."""
    windows = training_windows(tokenizer, source, budget.seq_len, validation)
    for _ in range(start_step * budget.batch_size):
        next(windows)
    for step in range(start_step, budget.steps):
        rows = budget.windows_of(step)
        ids = torch.stack([next(windows) for _ in range(rows)])
        yield step, ids, budget.mask_of(step)


__all__ = [
    "FOLDER_SUFFIXES",
    "TextSource",
    "TokenBudget",
    "budget_batches",
    "check_data_files",
    "check_windows",
    "count_windows",
    "folder_files",
    "packed_windows",
    "record_text",
    "source_documents",
    "training_windows",
    "validation_windows",
]
