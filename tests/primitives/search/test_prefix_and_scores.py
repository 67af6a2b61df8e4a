"""Scoring with the layers before a candidate skipped (``primitives/search/prefix.py``) gives the whole forward's
logits, on architectures whose layers read different masks and position embeddings (Gemma 3's sliding and full
layers); a candidate's score is the KL of the model with it in place (``primitives/search/scores.py``)."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.allocate.fitness import dense_log_probs, mean_kl
from slimkit.primitives.search.build import applied
from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.prefix import cached_prefix, record_layer_inputs
from slimkit.primitives.search.record import CandidateRecord
from slimkit.primitives.search.scores import candidate_kl
from tests.tiny import tiny_gemma3_text, tiny_llama, tiny_qwen3_moe


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3_text, tiny_qwen3_moe])
def test_a_skipped_prefix_gives_the_whole_forwards_logits(build):
    torch.manual_seed(0)
    model = build(layers=3)
    batches = [torch.randint(3, 300, (2, 12)) for _ in range(2)]
    recorded = record_layer_inputs(model, batches)
    assert len(recorded) == 3 and all(len(per_layer) == 2 for per_layer in recorded)
    with torch.no_grad():
        expected = [model(batch).logits for batch in batches]
    for start in (1, 2):
        with cached_prefix(model, start, recorded[start]), torch.no_grad():
            got = [model(batch).logits for batch in batches]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the layers are back
        assert torch.equal(model(batches[0]).logits, expected[0])


def test_a_candidates_score_is_the_kl_of_the_model_with_it():
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    held = [torch.randint(3, 300, (2, 12))]
    dense = dense_log_probs(model, held)
    recorded = record_layer_inputs(model, held)
    record = CandidateRecord(2, CandidateSpec("mlp", "removed"))
    score = candidate_kl(model, record, held, dense, recorded[2])
    with applied(model, record):
        expected = mean_kl(model, held, dense)
    assert score == pytest.approx(expected, rel=1e-5) and score > 0
    assert mean_kl(model, held, dense) == pytest.approx(0.0, abs=1e-9)
