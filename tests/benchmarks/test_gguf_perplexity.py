"""benchmarks.gguf_perplexity on a tiny Llama: llama.cpp scores slimkit's evaluation windows as PyTorch does."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gguf_perplexity import main
from slimkit.primitives.evaluate.llamacpp import gguf_perplexity_of_windows
from slimkit.primitives.evaluate.perplexity import perplexity_of_windows
from slimkit.primitives.export import export
from tests.tiny import bpe_tokenizer, tiny_llama

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")


def test_llamacpp_window_perplexity_equals_pytorch_on_float32(tmp_path):
    tokenizer = bpe_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer)).eval()
    path = tmp_path / "m.gguf"
    export(model, path, "gguf", "f32", tokenizer=tokenizer, force=True)
    windows = torch.randint(0, len(tokenizer), (3, 16), generator=torch.Generator().manual_seed(0))
    expected = perplexity_of_windows(model, windows)
    assert gguf_perplexity_of_windows(path, windows, threads=1, f32_cache=True) == pytest.approx(expected, rel=1e-4)


def test_cli_row_on_wikitext_windows(tmp_path, capsys):
    tokenizer = bpe_tokenizer()
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    argv = [str(tmp_path / "m"), "--max-tokens", "64", "--seq-len", "32", "--f32-cache", "--json", str(tmp_path / "r")]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["windows"] == 2 and row["tokens"] == 64 and row["gguf"]["architecture"] == "llama"
    assert abs(row["relative_difference"]) < 1e-4
    assert json.loads((tmp_path / "r").read_text()) == row


def test_an_out_that_is_a_file_is_one_line_before_any_work(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not slimkit's")
    assert main(["smollm2-135m", "--out", str(taken)]) == 2
    assert capsys.readouterr().err.startswith("error: --out")
    assert taken.read_text() == "not slimkit's"
