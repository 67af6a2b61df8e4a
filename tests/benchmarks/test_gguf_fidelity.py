"""benchmarks.gguf_fidelity on a tiny Granite (SiLU: llama.cpp exact with a float32 cache), widths made per-layer."""

from __future__ import annotations

import json

import pytest

from benchmarks.gguf_fidelity import main
from tests.tiny import bpe_tokenizer, tiny_granite

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")


def test_per_layer_granite_is_padded_and_matches(tmp_path, capsys):
    tokenizer = bpe_tokenizer()
    tiny_granite(vocab_size=len(tokenizer), layers=4).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    assert main([str(tmp_path / "m"), "--per-layer", "--out", str(tmp_path / "g")]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["architecture"] == "granite" and any("padded with zeros" in w for w in row["warnings"])
    assert row["llamacpp_f32_cache"]["max_rel_logit_diff"] < 1e-5
    assert abs(row["llamacpp_f32_cache"]["perplexity"] / row["torch_perplexity"] - 1) < 1e-4
