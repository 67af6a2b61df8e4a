"""Real tier: smollm2-135m results at 10% exported to GGUF run in llama.cpp with slimkit's perplexity.

One fixed window of 512 WikiText-2 tokens (token ids, so both sides see the same input). f32 files
must match slimkit's perplexity within 0.5%, q8_0 files within 3% (measured: +0.7% for the dense
model, q8_0's rounding of every weight; tensors whose rows are not blocks of 32 fall back to f16).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import slimkit
from slimkit.primitives.datasets import textdata
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.llamacpp import gguf_logits, load_gguf, nll_perplexity
from slimkit.primitives.evaluate.perplexity import corpus_ids
from slimkit.primitives.export import export
from slimkit.recipes.loading import load_recipe
from tests.tiny import assert_scaled_close

pytestmark = pytest.mark.real
pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")

SMALL = ["target.ratio=0.1", "calibration.samples=8", "calibration.batch_size=8", "eval.perplexity=null"]
RECIPES = {
    "wanda-channels": ([], "llama"),
    "llm-pruner": (["stages.1.args.steps=0", "target.ratio=0.2"], "deci"),  # 10% misses its target (8.2%)
    "lorap": (["stages.1.args.steps=0"], "llama"),
    "sp3-oneshot": (["stages.0.args.group_size=all"], "llama"),
}
TOLERANCE = {"f32": 0.005, "q8_0": 0.03}


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("real-cache")


@pytest.fixture(scope="module")
def window(real_cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
        _, tokenizer, _ = slimkit.load_source("smollm2-135m")
    return corpus_ids(tokenizer, textdata.text("wikitext2"), 512)[:512]


def _slimkit_perplexity(model, ids) -> float:
    with torch.no_grad():
        return nll_perplexity(model(ids[None]).logits[0], ids)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_result_runs_in_llamacpp_with_slimkits_perplexity(name, real_cache, window, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    extra, architecture = RECIPES[name]
    recipe, _raw = load_recipe(name, SMALL + extra)
    slimkit.run(recipe, tmp_path / "run")
    model, tokenizer = slimkit.load(tmp_path / "run" / "model")
    expected = _slimkit_perplexity(model, window)
    for type in TOLERANCE:
        result = export(model, tmp_path / f"{type}.gguf", "gguf", type, tokenizer=tokenizer)
        assert result.architecture == architecture and result.tokenizer_pre == "smollm" and not result.warnings
        actual = nll_perplexity(gguf_logits(result.path, window.tolist(), threads=2), window)
        print(name, type, f"slimkit {expected:.4f} llama.cpp {actual:.4f}", len(result.fallbacks), "fallbacks")
        assert actual == pytest.approx(expected, rel=TOLERANCE[type])
    if name == "lorap":
        assert result.merged and result.added_params > 0
    if name == "wanda-channels":  # llama.cpp splits text as the Hugging Face tokenizer does ("smollm" pre-tokenizer)
        text = textdata.text("wikitext2")[:3000]
        llama = load_gguf(result.path, n_ctx=64, threads=2)
        try:
            assert (
                list(llama.tokenize(text.encode(), add_bos=False, special=False))
                == tokenizer(text, add_special_tokens=False).input_ids
            )
        finally:
            llama.close()
    if name == "sp3-oneshot":  # 516 hidden features over 9 heads: LlamaConfig refuses it
        with pytest.raises(SlimkitError, match=r"LlamaConfig refuses these widths .*multiple.*--format gguf"):
            export(model, tmp_path / "hf", "hf", tokenizer=tokenizer)
    elif architecture == "llama":
        export(model, tmp_path / "hf", "hf", tokenizer=tokenizer)
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        with torch.no_grad():
            assert_scaled_close(plain(window[None, :64]).logits, model(window[None, :64]).logits)  # merged: fp order


def test_bundled_sp3_oneshot_result_is_refused_in_one_line(real_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(real_cache))
    recipe, _raw = load_recipe("sp3-oneshot", SMALL)
    slimkit.run(recipe, tmp_path / "run")
    with pytest.raises(
        SlimkitError, match=r"7 residual / basis-change matrices .*have no exact merge.*group_size: all"
    ) as error:
        export(tmp_path / "run" / "model", tmp_path / "m.gguf", "gguf")
    assert "\n" not in str(error.value) and not (tmp_path / "m.gguf").exists()
