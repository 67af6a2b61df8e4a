"""The offline teacher: top-k KL by hand and equal to the full KL at k = vocabulary, the cache computed once and read
back without loading the teacher, and the fingerprint following the weights' content."""

from __future__ import annotations

import math

import pytest
import torch

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.finetune.distill import distill_loss
from slimkit.primitives.finetune.teacher_cache import TopKCache, teacher_fingerprint, topk_kl
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
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(SlimkitError, match="holds no weight file"):
        teacher_fingerprint(tmp_path)
