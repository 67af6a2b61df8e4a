"""primitives/evaluate/glue_metrics.py: GLUE's metrics, computed by hand on small label vectors."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.evaluate.glue_metrics import (
    accuracy,
    average_ranks,
    f1_score,
    glue_metrics,
    pearson,
    spearman,
)


def test_accuracy_and_f1_by_hand() -> None:
    predictions = torch.tensor([1, 1, 0, 0, 1])
    labels = torch.tensor([1, 0, 0, 1, 1])
    assert accuracy(predictions, labels) == pytest.approx(3 / 5)
    # tp = 2 (positions 0, 4), fp = 1 (1), fn = 1 (3): F1 = 2·2 / (2·2 + 1 + 1)
    assert f1_score(predictions, labels) == pytest.approx(4 / 6)
    assert f1_score(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long)) == 0.0  # no true positive


def test_pearson_and_spearman_by_hand() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert pearson(x, -x) == pytest.approx(-1.0)
    assert pearson(x, torch.ones(4)) == 0.0  # a constant has no correlation (no division by zero)
    # x and y = [1, 0, 1, 0] centred: x - 2.5 = [-1.5, -0.5, 0.5, 1.5], y - 0.5 = [0.5, -0.5, 0.5, -0.5]
    # Σ = -0.75 + 0.25 + 0.25 - 0.75 = -1; |x| = √5, |y| = 1
    assert pearson(x, torch.tensor([1.0, 0.0, 1.0, 0.0])) == pytest.approx(-1 / 5**0.5)
    assert spearman(x, x.pow(3)) == pytest.approx(1.0)  # monotone: rank correlation 1, Pearson's below 1
    assert pearson(x, x.pow(3)) < 1.0


def test_average_ranks_share_ties() -> None:
    ranks = average_ranks(torch.tensor([10.0, 30.0, 20.0, 30.0, 5.0]))
    assert ranks.tolist() == [2.0, 4.5, 3.0, 4.5, 1.0]


def test_glue_metrics_per_task() -> None:
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])  # predictions 1, 0, 1, 0
    labels = torch.tensor([1, 0, 0, 0])
    assert glue_metrics("sst2", logits, labels) == {"accuracy": pytest.approx(0.75)}
    mrpc = glue_metrics("mrpc", logits, labels)
    assert mrpc["accuracy"] == pytest.approx(0.75) and mrpc["f1"] == pytest.approx(2 / 3)  # tp 1, fp 1, fn 0
    scores = torch.tensor([[0.5], [1.5], [1.0]])
    stsb = glue_metrics("stsb", scores, torch.tensor([1.0, 3.0, 2.0]))
    assert stsb["spearman"] == pytest.approx(1.0) and stsb["pearson"] == pytest.approx(1.0)
