"""Plans of the bundled prune configurations on real shapes, on meta-device models (shapes only, no weights).

The smollm2-135m counts were computed before solve_target existed (the shared fraction lands there, and the
published numbers depend on these exact units). On Llama-3.2-1B (32 query heads over 8 KV heads) one head step
over llm-pruner's 11 layers is ~1.9% of the model: the shared fraction removed 16 of 32 heads and 20.53%; one
fraction per kind keeps 24 heads and lands on 20.0%.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.scale import REAL
from slimkit.primitives.evaluate.counting import param_parts, params_by_part
from slimkit.primitives.groups import build_groups
from slimkit.primitives.select import SelectionRules, eligible_layers, kept_counts, solve_target
from slimkit.primitives.select.plan import removed_params

# recipe -> (groups, skip_first, skip_last), as in recipes/llm-pruner.yaml and recipes/magnitude.yaml
CONFIGS = {
    "llm-pruner": (["attention_head", "mlp_channel"], 3, 2),
    "magnitude": (["mlp_channel", "attention_head"], 0, 0),
}


def _plan(shape: str, recipe: str):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(REAL[shape].config("float32"))
    kinds, first, last = CONFIGS[recipe]
    layers = eligible_layers(model.config.num_hidden_layers, first, last)
    groups = [g for kind in kinds for g in build_groups(model, kind, layers)]
    scores = [torch.zeros(g.size) for g in groups]
    total = params_by_part(model)["total"]
    wanted = total - round(0.8 * total)
    fraction = solve_target(model, groups, scores, SelectionRules(), "model", wanted, round(0.005 * total))
    counts = kept_counts(groups, scores, fraction, SelectionRules())
    achieved = removed_params(model, groups, counts, "model", param_parts(model)) / total
    return (
        fraction,
        {kind: sorted({c for g, c in zip(groups, counts, strict=True) if g.kind == kind}) for kind in kinds},
        achieved,
    )


@pytest.mark.parametrize(
    ("recipe", "fraction", "kept"),
    [
        ("llm-pruner", 0.32194010416666696, {"attention_head": [6], "mlp_channel": [1041]}),
        ("magnitude", 0.2542317708333339, {"mlp_channel": [1145], "attention_head": [6]}),
    ],
)
def test_smollm2_plans_are_those_of_the_shared_fraction(recipe, fraction, kept):
    solved, counts, achieved = _plan("smollm2-135m", recipe)
    assert (solved, counts) == (fraction, kept)
    assert achieved == pytest.approx(0.2, abs=1e-4)


def test_llm_pruner_lands_on_the_llama_1b_shape():
    fraction, counts, achieved = _plan("llama-3.2-1b", "llm-pruner")
    assert isinstance(fraction, dict)
    assert counts == {"attention_head": [24], "mlp_channel": [4876]}
    assert achieved == pytest.approx(0.2, abs=0.005)
