"""`slimkit eval` and `slimkit inspect` on causal LMs slimkit has no compression adapter for (GPT-2, GPT-NeoX, Phi,
Falcon): evaluation needs no compression support, every folder check still applies, and compression recipes keep
refusing them in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import slimkit
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.io.folder import check_model_folder
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny_foreign import FOREIGN_CONFIGS, saved_tiny_foreign


@pytest.fixture(params=sorted(FOREIGN_CONFIGS))
def foreign_dir(request, tmp_path, tokenizer):
    return request.param, saved_tiny_foreign(request.param, tmp_path / request.param, tokenizer)


def test_loaded_for_evaluation_exactly_as_transformers_loads_it(foreign_dir):
    model_type, folder = foreign_dir
    model, tokenizer = slimkit.load(folder, purpose="evaluate")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, len(tokenizer), (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.config.model_type == model_type
    with pytest.raises(SlimkitError, match=f"model_type '{model_type}' is not supported for causal-lm recipes"):
        slimkit.load(folder)  # loading to compress still needs the adapter


def test_eval_and_inspect_any_causal_lm(foreign_dir, monkeypatch, capsys, tmp_path):
    model_type, folder = foreign_dir
    out = tmp_path / "results.json"
    code, _stdout, err = run_cli(
        monkeypatch, capsys, "eval", str(folder), "--seq-len", "32", "--max-tokens", "64", "--json", str(out)
    )
    assert code == 0, err
    result = json.loads(out.read_text())
    assert math.isfinite(result["metrics"]["wikitext2_ppl"]) and result["metrics"]["wikitext2_ppl"] > 1
    assert result["details"]["perplexity"][0]["tokens"] == 64

    code, stdout, err = run_cli(monkeypatch, capsys, "inspect", str(folder))
    assert code == 0, err
    assert f"model_type '{model_type}' is not supported for causal-lm recipes" in stdout
    assert "slimkit eval and inspect do" in stdout and f"{model_type}: hidden 32, 2 layers" in stdout


def test_recipes_refuse_what_they_cannot_compress_in_one_line(monkeypatch, capsys, tmp_path, tokenizer):
    folder = saved_tiny_foreign("gpt2", tmp_path / "gpt2", tokenizer)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps(tiny_recipe(str(folder))))
    code, _out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(recipe), "--out", str(tmp_path / "out"))
    refusal = "model_type 'gpt2' is not supported for causal-lm recipes; supported: deepseek_v3, gemma"
    assert_one_line_error(code, err, refusal)
    assert not (tmp_path / "out").exists()


def test_every_folder_check_still_applies_when_evaluating(tmp_path, tokenizer):
    folder = saved_tiny_foreign("gpt2", tmp_path / "gpt2", tokenizer)
    assert check_model_folder(folder, purpose="evaluate").task == "causal-lm"
    (folder / "extra.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(SlimkitError, match="holds 2 weight files"):
        check_model_folder(folder, purpose="evaluate")
    (folder / "extra.safetensors").unlink()
    (folder / "modeling_gpt2.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(SlimkitError, match="holds Python code"):
        check_model_folder(folder, purpose="evaluate")
    (folder / "modeling_gpt2.py").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(SlimkitError, match="quantization_config"):
        check_model_folder(folder, purpose="evaluate")
