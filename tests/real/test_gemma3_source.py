"""The second real model, ``gemma3-270m``: joined from its chunk packages, dequantised once into the cache, its
GGUF tokenizer as a transformers fast tokenizer, and a short evaluation through ``slimkit eval``."""

from __future__ import annotations

import json
import math

import pytest
import torch

import slimkit
from slimkit.primitives.evaluate.counting import count_params
from slimkit.primitives.evaluate.perplexity import bos_prefix
from slimkit.primitives.io.model_sources import resolve_source
from tests.cli.test_cli import run_cli

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def gemma_cache(tmp_path_factory):
    # One conversion for the module (joining, sha256 and dequantising: about a minute on 2 cores).
    return tmp_path_factory.mktemp("gemma-cache")


@pytest.fixture
def gemma3(gemma_cache, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(gemma_cache))
    return slimkit.load_source("gemma3-270m", device="cpu", dtype="float32", purpose="evaluate")


def test_gemma3_source_facts(gemma3, gemma_cache):
    model, tokenizer, info = gemma3
    config = model.config
    assert info.task == "causal-lm" and config.model_type == "gemma3_text"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (18, 640, 2048)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.layer_types.count("full_attention") == 3 and config.tie_word_embeddings
    assert count_params(model) == 268_098_176 and next(model.parameters()).dtype == torch.float32
    folder, _ = resolve_source("gemma3-270m")
    assert folder.is_relative_to(gemma_cache) and (folder / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not list(gemma_cache.rglob("*.gguf"))  # the joined GGUF is gone once dequantised
    assert tokenizer.is_fast and len(tokenizer) == config.vocab_size == 262_144
    assert bos_prefix(tokenizer) == tokenizer.bos_token_id == 2  # perplexity windows start with <bos>
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :])
    assert "France" in text or "Paris" in text, text


def test_gemma3_short_eval(gemma_cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(gemma_cache))
    out = tmp_path / "dense.json"
    args = ["eval", "gemma3-270m", "--seq-len", "256", "--max-tokens", "512", "--device", "cpu", "--json", str(out)]
    code, _stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    result = json.loads(out.read_text())
    ppl = result["metrics"]["wikitext2_ppl"]
    # A working dense 270M model: WikiText-2 in the tens (windows without <bos> give several times more).
    assert math.isfinite(ppl) and 5 < ppl < 50, ppl
    assert result["details"]["perplexity"][0]["tokens"] == 512
