"""A vision-language model's language model compressed by a recipe, the vision tower and projector kept: the saved
folder reloads as the same class with equal logits and generates from an image and a prompt (tiny Gemma 3)."""

from __future__ import annotations

import pytest
import torch

import slimkit
from benchmarks.exportable import shrink
from slimkit.primitives.arch import ModelView
from slimkit.primitives.io.vision_language import attached, language_model
from slimkit.recipes.loading import load_recipe, validate
from tests.tiny import bpe_tokenizer, gemma3_vlm_inputs, tiny_gemma3_vlm

PROMPT = [50, 60, 70, 80]


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer()


def _vocab(bpe) -> int:
    return len(bpe) + 3  # the image's begin, end and placeholder tokens after the text ones


def test_the_language_model_view_shares_every_module(bpe):
    model = tiny_gemma3_vlm(vocab_size=_vocab(bpe))
    text = language_model(model)
    assert type(text).__name__ == "Gemma3ForCausalLM" and attached(text) is model
    assert text.model is model.model.language_model and text.lm_head is model.lm_head
    assert text.config is model.config.text_config
    vision = sum(p.numel() for p in model.model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.model.multi_modal_projector.parameters())
    assert sum(p.numel() for p in text.parameters()) == sum(p.numel() for p in model.parameters()) - vision - projector
    assert ModelView(text).num_layers == 2
    ids = torch.tensor([PROMPT])
    with torch.no_grad():  # text alone: the view computes what the whole model computes
        torch.testing.assert_close(text(ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.slow
def test_a_recipe_compresses_the_language_model_and_the_result_answers_from_an_image(tmp_path, bpe):
    torch.manual_seed(0)
    model = tiny_gemma3_vlm(vocab_size=_vocab(bpe), layers=4)
    model.save_pretrained(tmp_path / "vlm")
    bpe.save_pretrained(tmp_path / "vlm")
    vision = {
        k: v.clone() for k, v in model.state_dict().items() if "language_model" not in k and k != "lm_head.weight"
    }
    _, raw = load_recipe("wanda-channels")
    raw, _ = shrink(raw, tmp_path / "vlm")
    result = slimkit.run(validate(raw, "wanda-channels"), tmp_path / "run", evaluate=False)
    target = result.report.as_json()["target"]
    assert abs(target["achieved"] - target["ratio"]) <= 0.04, target
    compressed = attached(result.model)
    assert type(compressed).__name__ == "Gemma3ForConditionalGeneration"

    loaded, _ = slimkit.load(tmp_path / "run" / "model")
    assert type(loaded) is type(model)
    assert ModelView(language_model(loaded)).layer_widths() == ModelView(result.model).layer_widths()
    assert sum(p.numel() for p in loaded.parameters()) < sum(p.numel() for p in model.parameters())
    for name, tensor in vision.items():  # the vision tower and the projector are untouched
        assert torch.equal(loaded.state_dict()[name], tensor), name
    inputs = gemma3_vlm_inputs(_vocab(bpe), PROMPT)
    with torch.no_grad():
        expected = compressed(**inputs).logits
        torch.testing.assert_close(loaded(**inputs).logits, expected, rtol=0, atol=0)
        other = loaded(**gemma3_vlm_inputs(_vocab(bpe), PROMPT, seed=1)).logits
    assert float((other - expected).abs().max()) > 1e-3  # the answer depends on the image
    answer = loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert answer.shape == (1, inputs["input_ids"].shape[1] + 4)
    assert torch.equal(answer, compressed.generate(**inputs, max_new_tokens=4, do_sample=False))
