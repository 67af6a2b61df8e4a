"""The offline teacher: top-k KL by hand and equal to the full KL at k = vocabulary, the cache computed once and read
back without loading the teacher, and the fingerprint following the weights' content."""

from __future__ import annotations

import math
import os

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.distill import distill_loss
from slimkit.primitives.finetune.teacher_cache import TopKCache, entry_problem, teacher_fingerprint, topk_kl
from tests.tiny import tiny_llama


def test_topk_kl_by_hand_and_at_full_vocabulary():
    # one token, teacher top-2 logits (0, 0) at tokens 1, 2: p = (1/2, 1/2); student log-probs there log(1/4), log(1/4)
    student = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    values, indices = torch.zeros(1, 1, 2), torch.tensor([[[1, 2]]])
    assert float(topk_kl(student, values, indices)) == pytest.approx(math.log(2))
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    full_values, full_indices = t.topk(11, dim=-1)
    torch.testing.assert_close(topk_kl(s, full_values, full_indices, 2.0), distill_loss(s, t, 2.0))


def test_the_cache_computes_once_and_later_runs_never_load_the_teacher(tmp_path):
    torch.manual_seed(0)
    teacher = tiny_llama()
    loads = []

    def load():
        loads.append(1)
        return teacher

    ids = torch.randint(3, 300, (2, 16))
    first = TopKCache(tmp_path, "fp", 8, load)
    values, indices = first.topk(ids)
    assert loads == [1] and values.shape == (2, 16, 8) and indices.dtype == torch.int32
    torch.testing.assert_close(values, teacher(input_ids=ids).logits.topk(8, dim=-1).values)

    def no_teacher():
        raise AssertionError("the teacher was loaded although every window is cached")

    second = TopKCache(tmp_path, "fp", 8, no_teacher)
    again = second.topk(ids)
    assert second.hits == 1 and torch.equal(again[0], values) and torch.equal(again[1], indices)
    assert TopKCache(tmp_path, "fp", 4, no_teacher).path_of(ids) != first.path_of(ids)  # k is in the key


def test_the_fingerprint_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 100)
    before = teacher_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"a" * 99 + b"b")
    assert teacher_fingerprint(tmp_path) != before
    middle = (4 << 20) + 7  # a byte in the middle of a 9 MiB file: not in its first or last MiB
    data = bytearray(b"w" * (9 << 20))
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    ends_alike = teacher_fingerprint(tmp_path)
    data[middle] = ord("x")
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert teacher_fingerprint(tmp_path) != ends_alike
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(SlimkitError, match="holds no weight file"):
        teacher_fingerprint(tmp_path)


SHAPE = (1, 2)


def entry(k: int = 2, **changes) -> dict:
    saved = {"values": torch.tensor([[[3.0, 1.0], [2.0, 0.5]]]), "indices": torch.tensor([[[4, 1], [0, 2]]]).int()}
    return {**saved, **changes}


@pytest.mark.parametrize(
    ("saved", "vocab", "problem"),
    [
        (entry(), 5, None),
        (entry(), None, None),
        ("text", 5, "not a dict of values and indices tensors"),
        (
            entry(indices=torch.tensor([[[4, 1], [0, 9]]]).int()),
            5,
            "token ids from 0 to 9, outside the vocabulary of 5",
        ),
        (entry(indices=torch.tensor([[[4, 1], [0, -1]]]).int()), None, "token ids from -1 to 4"),
        (entry(indices=torch.tensor([[[4, 1], [0, 2]]])), 5, "token ids are torch.int64, not int32"),
        (entry(values=torch.tensor([[[3.0, float("nan")], [2.0, 0.5]]])), 5, "not finite"),
        (entry(values=torch.zeros(1, 2, 3), indices=torch.zeros(1, 2, 3).int()), 5, "not [1, 2, 2] (another k"),
    ],
)
def test_entry_problem_by_hand(saved, vocab, problem):
    found = entry_problem(saved, SHAPE, 2, vocab)
    assert found is None if problem is None else problem in found


def test_damaged_entries_are_computed_again_with_a_note(tmp_path):
    torch.manual_seed(0)
    teacher = tiny_llama()
    ids = torch.randint(3, 300, (2, 16))
    cache = TopKCache(tmp_path, "fp", 8, lambda: teacher)
    values, indices = cache.topk(ids, 300)
    path = cache.path_of(ids)
    good = path.read_bytes()
    damages = {
        "truncated": lambda: path.write_bytes(good[: len(good) // 2]),
        "beyond the vocabulary": lambda: torch.save({"values": values, "indices": indices + 400}, path),
        "another k": lambda: torch.save({"values": values[..., :4], "indices": indices[..., :4]}, path),
    }
    for why, damage in damages.items():
        damage()
        again = TopKCache(tmp_path, "fp", 8, lambda: teacher)
        got = again.topk(ids, 300)
        assert torch.equal(got[0], values) and torch.equal(got[1], indices), why
        assert again.misses == 1 and len(again.damaged) == 1, why
        note = again.note("distill")
        assert note is not None and note.startswith("distill: 1 cached teacher entry was unusable and computed again")
        assert path.read_bytes() != b"" and TopKCache(tmp_path, "fp", 8, lambda: teacher).topk(ids, 300)[1].equal(
            got[1]
        )
    path.unlink()
    os.mkfifo(path)  # a planted FIFO is never read, nor replaced
    fifo = TopKCache(tmp_path, "fp", 8, lambda: teacher)
    assert torch.equal(fifo.topk(ids, 300)[0], values) and "not a regular file" in fifo.damaged[0] and path.is_fifo()
