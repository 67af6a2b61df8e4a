"""Final hidden states to logits as each family's forward computes them (:mod:`slimkit.primitives.arch.output_logits`):
hand-checked transforms on a one-row head, and slimkit's perplexity equal to the model's own forward on the same
windows for every family slimkit evaluates (the compressed ones and those it only evaluates)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from slimkit.primitives.arch import output_logits as module
from slimkit.primitives.arch.output_logits import OUTPUT_STEPS, head_path, output_logits, output_steps
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.perplexity import perplexity_of_windows
from tests.tiny import DECODERS, MOE_FAMILIES


class OneHead(nn.Module):
    """A model whose head is the identity on 3 features, with a config of ``model_type`` and ``values``."""

    def __init__(self, model_type: str, **values: float | None) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type, **values)
        self.head = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(3))

    def get_output_embeddings(self) -> nn.Module:
        return self.head


HIDDEN = torch.tensor([[2.0, -4.0, 0.5]])


@pytest.mark.parametrize(
    ("model_type", "values", "expected"),
    [
        ("llama", {}, HIDDEN),
        ("granite", {"logits_scaling": 4.0}, HIDDEN / 4),
        ("cohere", {"logit_scale": 0.5}, HIDDEN * 0.5),
        ("falcon_h1", {"lm_head_multiplier": 3.0}, HIDDEN * 3),
        ("gemma2", {"final_logit_softcapping": 2.0}, 2.0 * torch.tanh(HIDDEN / 2.0)),
        ("gemma2", {"final_logit_softcapping": None}, HIDDEN),  # the forward skips a None cap
        ("minicpm3", {"logits_scaling": 2.0}, HIDDEN / 2),  # the hidden states scaled before the head
    ],
)
def test_each_transform_by_hand(model_type, values, expected):
    torch.testing.assert_close(output_logits(OneHead(model_type, **values), HIDDEN), expected)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_transform_value_that_is_not_a_positive_number_is_one_line(value):
    with pytest.raises(SlimkitError, match=r"^config final_logit_softcapping is .*finite positive number"):
        output_steps(OneHead("gemma2", final_logit_softcapping=value))


SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
EVALUATED_ONLY = {
    "granitemoe": {"logits_scaling": 4.0},
    "granitemoeshared": {"logits_scaling": 4.0},
    "granitemoehybrid": {"logits_scaling": 4.0, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 8},
    "vaultgemma": {"final_logit_softcapping": 0.5},
    "gemma3n_text": {"final_logit_softcapping": 0.5, "num_kv_shared_layers": 0},
    "nanochat": {"final_logit_softcapping": 0.5},
    "recurrent_gemma": {"logits_soft_cap": 0.5},
    "cohere": {"logit_scale": 3.0},
    "cohere2": {"logit_scale": 3.0},
    "minicpm3": {"dim_model_base": 8, "num_key_value_heads": 4},
    "gpt2": {},
    "qwen3_next": {},
}
"""Families slimkit evaluates without compressing them, with the output transforms made to matter (tiny logits
would hide a skipped soft cap)."""


def _evaluated_only(model_type: str) -> nn.Module:
    extra = EVALUATED_ONLY[model_type]
    if model_type == "gemma3n_text":
        extra = {**extra, "layer_types": ["sliding_attention", "full_attention"]}
    config = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    return AutoModelForCausalLM.from_config(config)


def _family(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name in DECODERS:
        model = DECODERS[name](vocab_size=96)
    elif name in MOE_FAMILIES:
        model = MOE_FAMILIES[name](vocab_size=96)
    else:
        model = _evaluated_only(name)
    if name == "gemma2" or name == "gemma3_text":
        model.config.final_logit_softcapping = 0.5
    if output_steps(model):  # logits large enough for a cap or a scale to change the perplexity measurably
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(20.0)
    return model.eval()


def forward_perplexity(model: nn.Module, windows: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(windows, use_cache=False).logits[:, :-1].float()
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item())


FAMILIES = sorted({*DECODERS, *MOE_FAMILIES, *EVALUATED_ONLY})


@pytest.mark.parametrize("name", FAMILIES)
def test_perplexity_equals_the_models_own_forward(name):
    model = _family(name)
    windows = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(1))
    assert head_path(model, windows[:1, :8]) is not None  # evaluated a few rows at a time, not through a fallback
    torch.testing.assert_close(
        perplexity_of_windows(model, windows), forward_perplexity(model, windows), rtol=1e-5, atol=0
    )
    if output_steps(model):  # the transform matters here: the bare head would be measurably wrong
        with torch.no_grad():
            hidden = model.base_model(windows, use_cache=False)[0][:, :-1]
            bare = model.get_output_embeddings()(hidden).float()
        skipped = math.exp(F.cross_entropy(bare.reshape(-1, bare.shape[-1]), windows[:, 1:].reshape(-1)).item())
        assert abs(skipped - forward_perplexity(model, windows)) > 1e-3 * skipped


def test_every_listed_family_is_checked():
    assert set(OUTPUT_STEPS) - set(FAMILIES) == set(OTHER_LISTED)


OTHER_LISTED = ["beam", "cohere2_moe", "falcon_h1", "gemma4_text", "granite_swa", "granitemoe_swa", "xlstm"]
"""Listed families checked on their logits alone (falcon_h1's reference Mamba kernels are slow on a CPU)."""


@pytest.mark.parametrize("name", OTHER_LISTED)
def test_the_other_listed_families_give_their_forwards_logits(name):
    values = {step.key: 0.5 if step.op == "softcap" else 4.0 for step in OUTPUT_STEPS[name]}
    config = AutoConfig.for_model(name, **{**SMALL, **values})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert head_path(model, torch.randint(0, 96, (1, 8))) is not None


def test_an_unlisted_transform_falls_back_to_the_whole_forward(monkeypatch):
    """A family whose transform the table lacks fails the check against its forward and is evaluated whole."""
    model = _family("granite")
    windows = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    monkeypatch.setitem(module.OUTPUT_STEPS, "granite", ())
    assert head_path(model, windows[:1, :8]) is None
    torch.testing.assert_close(
        perplexity_of_windows(model, windows), forward_perplexity(model, windows), rtol=1e-5, atol=0
    )
