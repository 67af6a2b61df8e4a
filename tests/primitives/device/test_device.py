"""Device, dtype and memory budget: parsing, loading, saving, offloaded layer-wise compression.

The offload tests force accelerate to put decoder layers on disk (a CPU-only machine's "off the device")
with a ``max_memory`` smaller than the model, and check the compressed result equals the in-memory run's
exactly (the same float32 arithmetic on the same weights, one layer at a time).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import slimkit
from slimkit.primitives.device.offload import is_offloaded
from slimkit.primitives.device.placement import Placement, format_size, parse_size, resolve_device, resolve_dtype
from slimkit.primitives.errors import SlimkitError
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.tiny import byte_tokenizer, model_output, tiny_llama

CALIBRATION = {"dataset": "c4", "samples": 4, "seq_len": 32, "batch_size": 2}
LORAP = {
    "sequential": [
        {"stage": "lowrank", "args": {"method": "awsvd", "ratio": 0.1}},
        {"stage": "prune_layer", "args": {"scorer": "activation"}},
    ]
}


@pytest.fixture
def four_layer_dir(tmp_path):
    """A 4-layer tiny llama saved in small shards (about 60 KiB per layer, 300 KiB in all)."""
    tokenizer = byte_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), layers=4)
    path = tmp_path / "tiny4"
    model.save_pretrained(path, max_shard_size="30KB")
    tokenizer.save_pretrained(path)
    return path


def _recipe(model: object, stages: list | None = None) -> dict:
    return {
        "name": "device-test",
        "model": model,
        "seed": 0,
        "calibration": CALIBRATION,
        "target": {"ratio": 0.2, "of": "model", "tolerance": 0.03},
        "stages": stages or [LORAP],
        "eval": {"perplexity": None},
    }


# --- parsing -----------------------------------------------------------------------------------------


def test_sizes_parse_and_format():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("512mb") == 512_000_000
    assert parse_size(1024) == 1024
    assert format_size(3 * 2**20) == "3.00 MiB"
    for bad in ("lots", "-1GB", "0", True):
        with pytest.raises(SlimkitError, match="max_memory"):
            parse_size(bad)


def test_devices_and_dtypes_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(SlimkitError, match="unknown device 'gpu'; use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")
    with pytest.raises(SlimkitError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
    placement = Placement.resolve("cpu", "bfloat16", "1GiB")
    assert placement.describe() == {"device": "cpu", "dtype": "bfloat16", "max_memory": "1.00 GiB"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_one_line():
    with pytest.raises(SlimkitError, match="'cuda:1' requested but CUDA is not available"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu")


def test_recipe_model_shorthand_and_overrides():
    recipe = slimkit.Recipe.from_yaml("wanda-channels", overrides=["model.dtype=bfloat16", "model.device=cpu"])
    assert recipe.model.source == "smollm2-135m"
    assert (recipe.model.device, recipe.model.dtype) == ("cpu", "bfloat16")
    with pytest.raises(SlimkitError, match=r"model\.device: unknown device 'tpu'"):
        slimkit.Recipe.from_yaml("wanda-channels", overrides=["model.device=tpu"])


# --- loading and saving in a dtype ------------------------------------------------------------------


def test_load_in_bfloat16_and_save_dtype(tiny_llama_dir, tmp_path):
    model, _ = slimkit.load(tiny_llama_dir, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    result = slimkit.run(
        _recipe({"source": str(tiny_llama_dir), "save_dtype": "bfloat16"}), out=tmp_path / "run", force=True
    )
    assert result.report.as_json()["placement"]["save_dtype"] == "bfloat16"
    assert result.report.as_json()["placement"]["dtype"] == "float32"
    files = sorted((tmp_path / "run" / "model").glob("*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as handle:
        assert {handle.get_tensor(key).dtype for key in handle.keys()} == {torch.bfloat16}
    loaded, _ = slimkit.load(tmp_path / "run" / "model", dtype="bfloat16")
    ids = torch.randint(3, 200, (2, 12))
    torch.testing.assert_close(model_output(loaded, ids), model_output(result.model, ids), rtol=0, atol=0)


def test_given_model_keeps_its_dtype_and_refuses_a_different_one(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer)).to(torch.bfloat16)
    with pytest.raises(SlimkitError, match=r"model\.dtype: the recipe asks for float32 but the model given has"):
        slimkit.run(_recipe({"source": "x", "dtype": "float32"}), model=model, tokenizer=tokenizer)
    result = slimkit.run(_recipe("x"), model=model, tokenizer=tokenizer)
    assert result.report.as_json()["placement"]["dtype"] == "bfloat16"
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}


# --- offloading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stages",
    [
        [LORAP],
        [{"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}],
    ],
    ids=["lorap", "wanda-channels"],
)
def test_offloaded_layerwise_equals_in_memory(four_layer_dir, tmp_path, stages):
    dense = slimkit.run(_recipe(str(four_layer_dir), stages), out=tmp_path / "dense", force=True)
    budget = {"source": str(four_layer_dir), "max_memory": "200KB"}
    offloaded = slimkit.run(_recipe(budget, stages), out=tmp_path / "offloaded", force=True)
    assert is_offloaded(offloaded.model)
    assert "disk" in offloaded.model.hf_device_map.values()
    assert offloaded.report.as_json()["placement"]["offloaded"] is True
    assert offloaded.report.as_json()["target"]["achieved"] == dense.report.as_json()["target"]["achieved"]
    ids = torch.randint(3, 200, (2, 16))
    expected = model_output(dense.model, ids)
    torch.testing.assert_close(model_output(offloaded.model, ids), expected, rtol=0, atol=0)
    reloaded, _ = slimkit.load(tmp_path / "offloaded" / "model")
    torch.testing.assert_close(model_output(reloaded, ids), expected, rtol=0, atol=0)


def test_offloaded_model_refuses_whole_model_stages(four_layer_dir):
    prune = {"stage": "prune", "args": {"groups": ["mlp_channel"], "scorer": "magnitude"}}
    recipe = _recipe({"source": str(four_layer_dir), "max_memory": "200KB"}, [prune])
    with pytest.raises(SlimkitError, match="stage 'prune' works on the whole model at once"):
        slimkit.run(recipe)


def test_budget_below_one_layer_is_refused(four_layer_dir):
    with pytest.raises(SlimkitError, match="less than one decoder layer"):
        slimkit.load(four_layer_dir, max_memory="100KB")


def test_offloaded_load_forward_equals_in_memory(four_layer_dir):
    model, _ = slimkit.load(four_layer_dir)
    offloaded, _ = slimkit.load(four_layer_dir, max_memory="200KB")
    assert is_offloaded(offloaded)
    ids = torch.randint(3, 200, (1, 10))
    torch.testing.assert_close(model_output(offloaded, ids), model_output(model, ids), rtol=0, atol=0)


# --- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--device", "gpu"], "unknown device 'gpu'"),
        (["--dtype", "fp16"], "unknown dtype 'fp16'"),
        (["--max-memory", "lots"], "expected a size like 20GiB"),
        (["--max-memory", "100KB"], "less than one decoder layer"),
    ],
)
def test_cli_bad_placement_is_one_line_and_writes_nothing(
    monkeypatch, capsys, four_layer_dir, tmp_path, options, fragment
):
    out = tmp_path / "out"
    code, _, err = run_cli(
        monkeypatch, capsys, "recipe", "run", "wanda-channels", "--out", str(out), "--model", str(four_layer_dir),
        "--no-eval", *options,
    )  # fmt: skip
    assert_one_line_error(code, err, fragment)
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_cuda_without_cuda(monkeypatch, capsys, four_layer_dir, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(
        monkeypatch, capsys, "recipe", "run", "wanda-channels", "--out", str(out), "--model", str(four_layer_dir),
        "--device", "cuda",
    )  # fmt: skip
    assert_one_line_error(code, err, "CUDA is not available")
    assert not out.exists()
    code, _, err = run_cli(monkeypatch, capsys, "eval", str(four_layer_dir), "--device", "cuda")
    assert_one_line_error(code, err, "CUDA is not available")


def test_float16_training_stage_is_refused_before_loading(tiny_llama_dir):
    lora = {"stage": "lora", "args": {"steps": 1, "batch_size": 2, "seq_len": 16}}
    recipe = _recipe({"source": str(tiny_llama_dir), "dtype": "float16"}, [LORAP, lora])
    with pytest.raises(SlimkitError, match="stage 'lora' trains through the model, which float16 weights cannot"):
        slimkit.run(recipe)


def test_report_says_where_it_ran(four_layer_dir, tmp_path):
    slimkit.run(_recipe({"source": str(four_layer_dir), "max_memory": "200KB"}), out=tmp_path / "run")
    text = (tmp_path / "run" / "report.md").read_text()
    assert "Ran on cpu in float32; weights' budget 195.31 KiB (layers offloaded, one at a time on the device)." in text
