"""Every registered scorer on every group kind of a tiny llama: finite scores of the group's size, or a
clear refusal for a kind the scorer does not score."""

from __future__ import annotations

import pytest
import torch

from slimkit.primitives.calibration.gradients import accumulate_gradients
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.importance import SCORERS, score_group
from slimkit.stages.scoring import input_norms

KINDS = ("mlp_channel", "attention_head", "kv_group", "hidden_feature")


@pytest.fixture(scope="module")
def scored():
    from tests.tiny import tiny_llama

    model = tiny_llama()
    batches = [torch.randint(3, 250, (2, 12)) for _ in range(2)]
    stats = {"input_norms": input_norms(model, batches), "gradients": accumulate_gradients(model, batches)}
    stats["dense_consumers"] = _layer_grams(model, 1, batches)  # the obs scorer reads layer 1's consumer Grams
    return model, stats


def _layer_grams(model, index: int, batches) -> dict:
    from slimkit.primitives.arch import ModelView
    from slimkit.primitives.reconstruct import gram_hooks
    from slimkit.primitives.reconstruct.consumer import DenseConsumer

    layer = ModelView(model).layer(index)
    consumers = {role: layer.linear(role) for role in ("down", "o")}
    with gram_hooks(consumers) as grams, torch.no_grad():
        for batch in batches:
            model(batch)
    return {role: DenseConsumer(m.weight.detach().clone(), grams[role].gram) for role, m in consumers.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_scorer_on_every_group_kind(scored, name, kind):
    model, stats = scored
    layers = None if kind == "hidden_feature" else [1]
    [group] = build_groups(model, kind, layers)
    definition = SCORERS[name]
    if definition.kinds is not None and kind not in definition.kinds:
        with pytest.raises(SlimkitError, match=f"scorer {name} cannot score {kind}"):
            score_group(name, group, model, dict(stats), generator=torch.Generator().manual_seed(0))
        return
    scores = score_group(name, group, model, dict(stats), generator=torch.Generator().manual_seed(0))
    assert scores.shape == (group.size,) and torch.isfinite(scores).all()
    assert definition.summary, f"scorer {name} has no one-line docstring"
