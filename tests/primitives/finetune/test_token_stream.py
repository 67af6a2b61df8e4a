"""Packed token windows and the token budget: windows by hand, the last batch truncated to exactly the budget,
held-out windows never trained on, resuming skips exactly the consumed windows, local folders read through datasets."""

from __future__ import annotations

import json

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.token_stream import (
    TextSource,
    TokenBudget,
    budget_batches,
    check_data_files,
    check_windows,
    count_windows,
    packed_windows,
    source_documents,
    validation_windows,
)


class _CharTokenizer:
    """One id per character (its code), end-of-text id 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_packed_windows_by_hand():
    windows = list(packed_windows(_CharTokenizer(), iter(["abc", "de", "fghij"]), 4))
    # a b c <eos> | d e <eos> f | g h i j | <eos> (dropped: shorter than a window)
    assert [w.tolist() for w in windows] == [[97, 98, 99, 0], [100, 101, 0, 102], [103, 104, 105, 106]]


@pytest.mark.parametrize(("tokens", "batch", "seq", "steps", "last_rows"), [(100, 2, 16, 4, 1), (96, 2, 16, 3, 2)])
def test_the_budget_is_honoured_exactly(tokens, batch, seq, steps, last_rows):
    budget = TokenBudget(tokens, batch, seq)
    assert budget.steps == steps and budget.windows_of(steps - 1) == last_rows
    assert sum(int(budget.mask_of(s).sum()) for s in range(steps)) == tokens
    # 100 = 3 x 32 + 4: the last step reads one window and counts its first 4 tokens
    if tokens == 100:
        assert budget.mask_of(3).tolist() == [[True] * 4 + [False] * 12]


def test_budget_batches_skip_validation_and_resume_at_the_same_windows(tokenizer):
    source = TextSource("alpaca", seed=3)
    budget = TokenBudget(5 * 2 * 16, 2, 16)
    held = validation_windows(tokenizer, source, 16, 3)
    stream = list(packed_windows(tokenizer, source_documents(source), 16))[:13]
    batches = list(budget_batches(tokenizer, source, budget, validation=3))
    assert torch.equal(held, torch.stack(stream[:3]))
    assert torch.equal(torch.cat([ids for _s, ids, _m in batches]), torch.stack(stream[3:13]))
    resumed = list(budget_batches(tokenizer, source, budget, validation=3, start_step=3))
    assert [s for s, _i, _m in resumed] == [3, 4]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches[3:], resumed, strict=True))


def test_a_local_folder_of_text_jsonl_and_parquet(tmp_path):
    import pandas

    (tmp_path / "a.txt").write_text("line one\nline two\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "json text"}) + "\n" + json.dumps({"instruction": "Do", "output": "done"}) + "\n"
    )
    pandas.DataFrame({"text": ["parquet row"]}).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "ignored.csv").write_text("x\n")
    docs = list(source_documents(TextSource(folder=str(tmp_path))))
    assert docs == ["line one\nline two\n", "json text", "### Instruction:\nDo\n\n### Response:\ndone", "parquet row"]


def test_a_folder_without_data_and_a_source_too_short_are_one_line(tmp_path, tokenizer):
    with pytest.raises(SlimkitError, match="holds no data file"):
        list(source_documents(TextSource(folder=str(tmp_path))))
    (tmp_path / "a.txt").write_text("short")
    with pytest.raises(SlimkitError, match="validation set needs 2"):
        validation_windows(tokenizer, TextSource(folder=str(tmp_path)), 64, 2)


def test_windows_are_counted_by_hand_up_to_what_is_needed(tmp_path):
    # 25 characters + <eos> = 26 tokens: 6 windows of 4 (the last 2 tokens dropped)
    (tmp_path / "a.txt").write_text("x" * 25)
    source = TextSource(folder=str(tmp_path))
    assert count_windows(_CharTokenizer(), source, 4, 100) == 6
    assert count_windows(_CharTokenizer(), source, 4, 3) == 3  # stops once it has what is needed
    check_windows(_CharTokenizer(), source, 4, 5)  # 5 held out, 1 to train on
    with pytest.raises(SlimkitError, match=r"^data_folder .* gives 6 windows of 4 tokens; training needs 7 \(vali"):
        check_windows(_CharTokenizer(), source, 4, 6)


@pytest.mark.parametrize(
    ("name", "data", "fragment"),
    [
        ("a.txt", bytes(range(256)), "holds binary data (a NUL byte), not text"),
        ("a.txt", b"caf\xe9 au lait", "is not UTF-8 text (invalid continuation byte at byte 3)"),
        ("a.jsonl", b'{"body": "no text field"}\n', "a record has neither a text field nor instruction/output"),
        ("a.jsonl", b"not json at all\n", "cannot read data file"),
    ],
)
def test_data_files_that_cannot_give_text_are_refused(tmp_path, name, data, fragment):
    (tmp_path / "good.txt").write_text("plain text")
    (tmp_path / name).write_bytes(data)
    with pytest.raises(SlimkitError) as raised:
        check_data_files(tmp_path)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_a_parquet_file_without_a_text_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["fine"]}), tmp_path / "a.parquet")
    check_data_files(tmp_path)
    pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "b.parquet")
    with pytest.raises(SlimkitError, match=r"b\.parquet: a record has neither a text field"):
        check_data_files(tmp_path)
