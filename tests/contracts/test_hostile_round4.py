"""Hostile inputs, round four: evaluation through each family's own output (class 1), caches and checkpoints keyed by
content (class 2), deletions only of what slimkit marked (class 3), launched processes that disagree (class 4), model
folders transformers refuses or that break later (class 5), impossible work found before it starts (class 6) and
memory and path limits (class 8).

A refusal asserts one ``error:`` line naming what is wrong, exit status 2 and a file tree under ``tmp_path``
byte-for-byte as it was; a kept result asserts exit status 0, the number or the note, and that nothing outside the
output changed. Each table has several cases per class; ``torchrun`` cases are in ``tests/engine/test_processes.py``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch.nn import functional as F

import slimkit
from slimkit.engine import runner
from slimkit.engine.output_safety import checkpoint_root
from slimkit.primitives import export as export_module
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.perplexity import bos_prefix, corpus_ids, windows_of
from slimkit.primitives.finetune.checkpoint import CHECKPOINT_MARKER
from slimkit.primitives.finetune.teacher_cache import teacher_fingerprint
from slimkit.stages import recovery_settings
from tests.cli.test_cli import run_cli
from tests.contracts.hostile import (
    copy_model,
    edit_json,
    plain_model,
    recipe_file,
    tree_checksum,
    weights_of,
    write_weights,
)
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import bpe_tokenizer, tiny_gemma2, tiny_granite, tiny_mixtral

SMALL_EVAL = ["--seq-len", "32", "--max-tokens", "128"]
TIME_LIMIT_S = 120


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Saved tiny models: llama, granite, gemma2 (its final soft cap made to matter) and a mixtral of 6 experts."""
    root = tmp_path_factory.mktemp("round4")
    tokenizer = bpe_tokenizer()
    made = {"llama": plain_model(root, "llama")}
    torch.manual_seed(0)
    for name, factory in (("granite", tiny_granite), ("gemma2", tiny_gemma2), ("mixtral", tiny_mixtral)):
        model = factory(vocab_size=len(tokenizer))
        if name in ("granite", "gemma2"):
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(20.0)  # logits large enough for the transform to matter
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        made[name] = root / name
    edit_json(made["gemma2"] / "config.json", lambda c: c.update(final_logit_softcapping=2.0))
    return made


class Case(NamedTuple):
    id: str
    cls: str
    build: Callable[[Path, dict[str, Path], pytest.MonkeyPatch], list[str]]
    fragment: str


def _never(what: str) -> Callable[..., object]:
    def refuse(*_args, **_kwargs):
        raise AssertionError(f"{what} ran before the input was refused")

    return refuse


def _run(tmp: Path, model: Path, name: str = "recipe.yaml", **changes) -> list[str]:
    return ["recipe", "run", str(recipe_file(tmp, model, name, **changes)), "--out", str(tmp / "out")]


# --- class 5: model folders transformers refuses, or that break later -------------------------------------------


def heads_do_not_divide(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_attention_heads=5, num_key_value_heads=5, head_dim=None))
    return ["eval", str(folder), *SMALL_EVAL]


def heads_do_not_divide_in_a_run(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_attention_heads=7, num_key_value_heads=7, head_dim=None))
    return _run(tmp, folder)


def no_hidden_size(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    edit_json(folder / "config.json", lambda c: c.pop("hidden_size"))
    return ["inspect", str(folder)]


def negative_soft_cap(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["gemma2"], tmp)
    edit_json(folder / "config.json", lambda c: c.update(final_logit_softcapping=-30.0))
    return _run(tmp, folder)


def zero_logits_scaling(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["granite"], tmp)
    edit_json(folder / "config.json", lambda c: c.update(logits_scaling=0))
    return ["eval", str(folder), *SMALL_EVAL]


def more_routed_than_experts(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["mixtral"], tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_experts_per_tok=7))
    return ["export", str(folder), "--out", str(tmp / "m.gguf")]


def no_tokenizer(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    mp.setattr("slimkit.primitives.io.model_sources.load_source", _never("loading the weights"))
    return ["eval", str(folder), *SMALL_EVAL]


def config_100000_deep(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    text = (folder / "config.json").read_text().rstrip().removesuffix("}")
    (folder / "config.json").write_text(text + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return ["export", str(folder), "--format", "hf", "--out", str(tmp / "hf")]


def int8_weights(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    tensors = weights_of(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = (tensors["model.layers.0.mlp.up_proj.weight"] * 50).to(torch.int8)
    write_weights(folder / "model.safetensors", tensors)
    return ["eval", str(folder), *SMALL_EVAL]


def float8_weights(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    folder = copy_model(f["llama"], tmp)
    tensors = weights_of(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"].to(
        torch.float8_e4m3fn
    )
    write_weights(folder / "model.safetensors", tensors)
    return _run(tmp, folder)


# --- class 6: impossible work refused before it starts ----------------------------------------------------------


def experts_25_percent_of_6(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    mp.setattr(runner, "calibration_batches", _never("calibration"))
    stages = [{"stage": "prune_experts", "args": {"allocation": "uniform"}}]
    return _run(tmp, f["mixtral"], target={"ratio": 0.25, "of": "mlp"}, stages=stages)


def experts_between_counts_merge(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    mp.setattr(runner, "calibration_batches", _never("calibration"))
    stages = [{"stage": "merge_experts", "args": {"allocation": "uniform"}}]
    return _run(tmp, f["mixtral"], target={"ratio": 0.42, "of": "mlp"}, stages=stages)


def experts_more_than_layers_lose(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    mp.setattr(runner, "calibration_batches", _never("calibration"))
    stages = [{"stage": "prune_experts", "args": {"allocation": "global"}}]
    return _run(tmp, f["mixtral"], target={"ratio": 0.8, "of": "mlp"}, stages=stages)


def _training_on(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch, files: dict[str, bytes], **args) -> list[str]:
    data = tmp / "data"
    data.mkdir()
    for name, content in files.items():
        (data / name).write_bytes(content)
    mp.setattr(runner, "calibration_batches", _never("calibration"))  # the pruning before training needs it
    lora = {"stage": "lora", "args": {"tokens": 256, "batch_size": 2, "seq_len": 32, "data_folder": str(data), **args}}
    prune = {"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}
    return _run(tmp, f["llama"], stages=[prune, lora])


def data_of_empty_files(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return _training_on(tmp, f, mp, {"a.txt": b"", "b.txt": b""})


def binary_text_file(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return _training_on(tmp, f, mp, {"a.txt": b"enough text " * 500, "z.txt": bytes(range(256)) * 8})


def jsonl_without_text(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return _training_on(tmp, f, mp, {"a.jsonl": b'{"body": "hello"}\n{"body": "world"}\n'})


def parquet_without_text(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"content": ["some words " * 40] * 20}), buffer)
    return _training_on(tmp, f, mp, {"a.txt": b"text " * 2000, "b.parquet": buffer.getvalue()})


def absurd_validation(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return _training_on(tmp, f, mp, {"a.txt": b"hello world " * 400}, validation_windows=1_000_000)


# --- class 8: memory and path limits -----------------------------------------------------------------------------


def export_out_of_memory(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    def no_memory(*_args, **_kwargs):
        raise MemoryError

    mp.setattr(export_module, "write_hf", no_memory)
    return ["export", str(f["llama"]), "--format", "hf", "--out", str(tmp / "hf")]


def eval_load_out_of_memory(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    def no_memory(*_args, **_kwargs):
        raise MemoryError

    mp.setattr(importlib.import_module("slimkit.primitives.io.load"), "_load_tokenizer", no_memory)
    return ["eval", str(f["llama"]), *SMALL_EVAL]


def export_name_over_name_max(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return ["export", str(f["llama"]), "--format", "hf", "--out", str(tmp / ("n" * 300))]


def gguf_name_over_name_max(tmp: Path, f: dict[str, Path], mp: pytest.MonkeyPatch) -> list[str]:
    return ["export", str(f["llama"]), "--out", str(tmp / ("g" * 256 + ".gguf"))]


CASES = [
    Case(
        "heads-do-not-divide", "5", heads_do_not_divide, "hidden_size 48, num_attention_heads 5: transformers refuses"
    ),
    Case("heads-do-not-divide-run", "5", heads_do_not_divide_in_a_run, "num_attention_heads 7: transformers refuses"),
    Case("no-hidden-size", "5", no_hidden_size, "config.json: no hidden_size; transformers would build the model"),
    Case("negative-soft-cap", "5", negative_soft_cap, "final_logit_softcapping must be a finite positive number"),
    Case("zero-logits-scaling", "5", zero_logits_scaling, "logits_scaling must be a finite positive number or null"),
    Case("top-k-above-experts", "5", more_routed_than_experts, "num_experts_per_tok 7 is more than the 6 experts"),
    Case("no-tokenizer", "5", no_tokenizer, "has no tokenizer (none of tokenizer.json, tokenizer_config.json"),
    Case("config-100000-deep", "5", config_100000_deep, "config.json: nested more than 32 levels deep"),
    Case("int8-weights", "5", int8_weights, "up_proj.weight is stored as I8, not a floating-point type"),
    Case("float8-weights", "5", float8_weights, "q_proj.weight is stored as F8_E4M3, not a floating-point type"),
    Case("experts-25-of-6", "6", experts_25_percent_of_6, "whole experts cannot remove 25.0% of mlp within target"),
    Case("experts-merge-42", "6", experts_between_counts_merge, "merge_experts: whole experts cannot remove 42.0%"),
    Case("experts-too-many", "6", experts_more_than_layers_lose, "more than the 8 the layers can lose"),
    Case("data-empty-files", "6", data_of_empty_files, "gives 0 windows of 32 tokens; training needs 9"),
    Case("data-binary-txt", "6", binary_text_file, "z.txt holds binary data (a NUL byte), not text"),
    Case("data-jsonl-no-text", "6", jsonl_without_text, "a.jsonl: a record has neither a text field"),
    Case("data-parquet-no-text", "6", parquet_without_text, "b.parquet: a record has neither a text field"),
    Case("data-absurd-validation", "6", absurd_validation, "training needs 1000001 (validation_windows 1000000"),
    Case("export-out-of-memory", "8", export_out_of_memory, "the export ran out of host memory"),
    Case("eval-load-out-of-memory", "8", eval_load_out_of_memory, "loading the model ran out of host memory"),
    Case("export-name-300", "8", export_name_over_name_max, "a file name is at most 255 bytes, this one 300"),
    Case("gguf-name-261", "8", gguf_name_over_name_max, "a file name is at most 255 bytes, this one 261"),
]


class _Blocked(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Blocked("the command blocked")


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_round4_input_is_refused_in_one_line(case, folders, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    args = case.build(tmp_path, folders, monkeypatch)
    before = tree_checksum(tmp_path, skip=("cache",))
    models_before = {name: tree_checksum(path) for name, path in folders.items()}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        code, out, err = run_cli(monkeypatch, capsys, *args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.fragment in lines[0], lines[0]
    assert tree_checksum(tmp_path, skip=("cache",)) == before
    assert {name: tree_checksum(path) for name, path in folders.items()} == models_before


def test_each_class_has_several_cases():
    per_class: dict[str, int] = {}
    for case in CASES:
        per_class[case.cls] = per_class.get(case.cls, 0) + 1
    assert len({case.id for case in CASES}) == len(CASES)
    assert all(count >= 3 for count in per_class.values()), per_class


# --- class 1: evaluated as the model computes -------------------------------------------------------------------


def _forward_perplexity(folder: Path, seq_len: int = 32, max_tokens: int = 128) -> float:
    """The perplexity the model's own forward gives on the windows slimkit evaluates."""
    from slimkit.primitives.datasets import textdata

    model, tokenizer = slimkit.load(folder, device="cpu", dtype="float32")
    ids = corpus_ids(tokenizer, textdata.text("wikitext2"), max_tokens)
    windows = windows_of(ids, seq_len, max_tokens, bos_prefix(tokenizer))
    with torch.no_grad():
        logits = model(windows, use_cache=False).logits[:, :-1].float()
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item())


@pytest.mark.parametrize("family", ["granite", "gemma2", "llama"])
def test_eval_reports_the_models_own_perplexity(family, folders, monkeypatch, capsys, tmp_path):
    before = tree_checksum(folders[family])
    code, _out, err = run_cli(
        monkeypatch, capsys, "eval", str(folders[family]), *SMALL_EVAL, "--json", str(tmp_path / "e.json")
    )
    assert code == 0, err
    measured = json.loads((tmp_path / "e.json").read_text())["metrics"]["wikitext2_ppl"]
    assert measured == pytest.approx(_forward_perplexity(folders[family]), rel=1e-5)
    assert tree_checksum(folders[family]) == before


@pytest.mark.slow
def test_the_soft_cap_changes_the_perplexity(folders, monkeypatch, capsys, tmp_path):
    folder = copy_model(folders["gemma2"], tmp_path)
    values = []
    for cap in (2.0, 50.0):
        edit_json(folder / "config.json", lambda c, cap=cap: c.update(final_logit_softcapping=cap))
        json_out = tmp_path / f"cap{cap}.json"
        code, _out, err = run_cli(monkeypatch, capsys, "eval", str(folder), *SMALL_EVAL, "--json", str(json_out))
        assert code == 0, err
        values.append(json.loads(json_out.read_text())["metrics"]["wikitext2_ppl"])
        assert values[-1] == pytest.approx(_forward_perplexity(folder), rel=1e-5)
    assert abs(values[0] - values[1]) > 1e-3 * values[0]


@pytest.mark.slow
def test_a_runs_report_and_dense_comparison_are_the_models_own(folders, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    recipe = recipe_file(tmp_path, folders["granite"])
    code, _out, err = run_cli(monkeypatch, capsys, "recipe", "run", str(recipe), "--out", str(tmp_path / "o"))
    assert code == 0, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    compressed = _forward_perplexity(tmp_path / "o" / "model")
    assert report["metrics"]["wikitext2_ppl"] == pytest.approx(compressed, rel=1e-5)
    dense = _forward_perplexity(folders["granite"])
    assert report["dense"]["metrics"]["wikitext2_ppl"] == pytest.approx(dense, rel=1e-5)


# --- class 2: caches and checkpoints keyed by content; damaged entries recomputed --------------------------------

TOKENS = 4 * 2 * 32 - 5
RECOVERY = {"tokens": TOKENS, "batch_size": 2, "seq_len": 32, "validation_windows": 2, "learning_rate": 5e-3}


def _recovery_recipe(model: Path, stage: str = "lora", **args) -> dict:
    return tiny_recipe(model, target={"ratio": 0}, stages=[{"stage": stage, "args": {**RECOVERY, **args}}])


def _bump_a_weight(folder: Path) -> None:
    """The weights replaced by others of the same shapes (one value in the middle of one tensor)."""
    tensors = weights_of(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] += 0.5
    write_weights(folder / "model.safetensors", tensors)


@pytest.mark.slow
def test_the_offline_teacher_follows_the_weights_and_recomputes_damaged_entries(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = copy_model(folders["llama"], tmp_path)
    raw = _recovery_recipe(folder, "distill", top_k=8)
    first = slimkit.run(raw, tmp_path / "o1", evaluate=False).report.as_json()["stages"]["distill"]
    assert first["windows_computed"] > 0
    _bump_a_weight(folder)
    second = slimkit.run(raw, tmp_path / "o2", evaluate=False).report.as_json()
    assert second["stages"]["distill"]["windows_computed"] == first["windows_computed"]  # nothing stale reused
    entries = sorted((tmp_path / "cache" / "teacher-topk" / teacher_fingerprint(folder)).rglob("*.pt"))
    entries[0].write_bytes(entries[0].read_bytes()[:100])  # truncated
    torch.save(
        {"values": torch.zeros(2, 32, 8), "indices": torch.full((2, 32, 8), 10**6, dtype=torch.int32)}, entries[1]
    )
    third = slimkit.run(raw, tmp_path / "o3", evaluate=False).report.as_json()
    assert third["stages"]["distill"]["windows_computed"] >= 1 and third["stages"]["distill"]["stopped"] is None
    assert any("cached teacher entries were unusable and computed again" in note for note in third["notes"])
    assert third["stages"]["distill"]["losses"] == second["stages"]["distill"]["losses"]


@pytest.mark.slow
def test_a_checkpoint_of_replaced_weights_is_not_resumed(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = copy_model(folders["llama"], tmp_path)
    raw = _recovery_recipe(folder, checkpoint_every=1)
    original = recovery_settings.recover_in_tokens

    def killed_at_step_2(*args, **kwargs):
        def progress(step, tokens, result):
            if step == 2:
                raise KeyboardInterrupt

        return original(*args[:7], progress, *args[8:], **kwargs)

    monkeypatch.setattr(recovery_settings, "recover_in_tokens", killed_at_step_2)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        slimkit.run(raw, out, evaluate=False)
    assert any(checkpoint_root(out).iterdir())
    monkeypatch.setattr(recovery_settings, "recover_in_tokens", original)
    _bump_a_weight(folder)
    report = slimkit.run(raw, out, evaluate=False).report.as_json()
    assert report["stages"]["lora"]["resumed_from_step"] is None
    assert any("was written for another recipe or input model" in note for note in report["notes"])
    assert not checkpoint_root(out).exists()


@pytest.mark.slow
def test_the_dense_comparison_never_measures_weights_rewritten_during_the_run(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = copy_model(folders["llama"], tmp_path)
    calibrate = runner._calibrate

    def rewrite_then_calibrate(ctx):
        _bump_a_weight(folder)  # the run paused, its source rewritten meanwhile
        return calibrate(ctx)

    monkeypatch.setattr(runner, "_calibrate", rewrite_then_calibrate)
    report = slimkit.run(str(recipe_file(tmp_path, folder)), out=tmp_path / "o").report.as_json()
    assert report["dense"] is None
    assert any(
        "no dense comparison: the dense model's files in" in n and "model.safetensors" in n for n in report["notes"]
    )


# --- class 3: only what slimkit marked is deleted ---------------------------------------------------------------


def _users_checkpoint_folder(tmp: Path) -> Path:
    root = checkpoint_root(tmp / "out")
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "plan.txt").write_text("the user's own folder, named like slimkit's")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True], ids=["no-training", "training"])
def test_a_checkpoint_folder_slimkit_did_not_make_is_kept(training, folders, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    root = _users_checkpoint_folder(tmp_path)
    changes = {"target": {"ratio": 0}, "stages": [{"stage": "lora", "args": {**RECOVERY, "checkpoint_every": 2}}]}
    recipe = recipe_file(tmp_path, folders["llama"], **(changes if training else {}))
    before = tree_checksum(tmp_path, skip=("cache", "out", root.name))
    users = tree_checksum(root)
    code, _out, err = run_cli(
        monkeypatch, capsys, "recipe", "run", str(recipe), "--out", str(tmp_path / "out"), "--no-eval"
    )
    assert code == 0, err
    assert tree_checksum(root) == users  # its own checkpoints, marked, went; the folder and the user's files stay
    assert tree_checksum(tmp_path, skip=("cache", "out", root.name)) == before


@pytest.mark.slow
def test_a_file_put_in_a_marked_checkpoint_is_kept(folders, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    raw = _recovery_recipe(folders["llama"], checkpoint_every=1)
    original = recovery_settings.recover_in_tokens
    out = tmp_path / "run"

    def add_a_file_at_step_2(*args, **kwargs):
        def progress(step, tokens, result):
            if step == 2:
                (folder,) = [p for p in checkpoint_root(out).iterdir() if (p / CHECKPOINT_MARKER).is_file()]
                (folder / "mine.txt").write_text("a user's file")

        return original(*args[:7], progress, *args[8:], **kwargs)

    monkeypatch.setattr(recovery_settings, "recover_in_tokens", add_a_file_at_step_2)
    slimkit.run(raw, out, evaluate=False)
    kept = list(checkpoint_root(out).rglob("mine.txt"))
    assert len(kept) == 1 and kept[0].read_text() == "a user's file"
    assert sorted(p.name for p in kept[0].parent.iterdir()) == ["mine.txt"]  # slimkit's own files went


# --- class 8: the Python API's save target and a memory error outside any step ---------------------------------


@pytest.mark.parametrize(
    ("target", "fragment"),
    [
        ("/proc/slimkit-round4", "cannot create the lock file beside it"),
        ("/dev/null/model", "/dev/null is a file, not a folder"),
        ("/sys/slimkit-round4", "slimkit.save /sys/slimkit-round4"),
    ],
)
def test_save_into_a_place_no_folder_can_be_written_is_one_line(target, fragment, folders):
    if not Path(target).parent.exists():
        pytest.skip(f"{Path(target).parent} does not exist here")
    model, tokenizer = slimkit.load(folders["llama"])
    with pytest.raises(SlimkitError) as raised:
        slimkit.save(model, tokenizer, target)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    assert not os.path.lexists(target)


@pytest.mark.slow
def test_a_memory_error_outside_every_step_is_one_line(folders, tmp_path):
    code = (
        "import sys\n"
        "import slimkit.primitives.io.model_sources as sources\n"
        "def no_memory(*a, **k):\n    raise MemoryError\n"
        "sources.check_source = no_memory\n"
        f"sys.argv = ['slimkit', 'eval', {str(folders['llama'])!r}, '--seq-len', '32', '--max-tokens', '128']\n"
        "from slimkit.cli.main import main\nmain()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: slimkit ran out of host memory")
    assert list(tmp_path.iterdir()) == []


# --- class 4: launched processes given different inputs refuse together (more in tests/engine/test_processes.py) --


def _launch_two(tmp: Path, recipe: Path, per_rank: str, port: int) -> subprocess.CompletedProcess:
    """``torchrun`` two processes of ``slimkit recipe run recipe``; ``per_rank`` (Python) runs first in each, with
    ``rank`` set, to give it its own arguments or environment."""
    wrapper = tmp / "launch.py"
    wrapper.write_text(
        "import os, sys\nrank = int(os.environ['LOCAL_RANK'])\n"
        f"args = ['recipe', 'run', {str(recipe)!r}, '--out', {str(tmp / 'out')!r}, '--no-eval', '--no-dense']\n"
        f"{per_rank}\nsys.argv = ['slimkit', *args]\nfrom slimkit.cli.main import main\nmain()\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SLIMKIT_CACHE_DIR": str(tmp / "cache")}
    return subprocess.run([*command, str(wrapper)], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two interpreters under torchrun
@pytest.mark.parametrize(
    ("per_rank", "fragment"),
    [
        ("args += ['--set', f'target.ratio={0.25 if rank else 0.2}']", "the recipe of rank 1 differs"),
        ("os.environ['SLIMKIT_DATA_DIR'] = os.environ['DATA_OF_RANK_' + str(rank)]", "the data of rank 1 differs"),
    ],
    ids=["widths", "data"],
)
def test_processes_given_different_inputs_stop_together(per_rank, fragment, folders, tmp_path, monkeypatch):
    from slimkit.primitives.datasets.data_paths import data_root

    for rank in (0, 1):  # the shipped corpora, the second copy's c4 one document longer
        copy = tmp_path / f"data{rank}"
        (copy / "c4").mkdir(parents=True)
        text = (data_root() / "c4" / "c4_validation_2k.jsonl").read_text()
        (copy / "c4" / "c4_validation_2k.jsonl").write_text(text + ('{"text": "one more"}\n' if rank else ""))
        monkeypatch.setenv(f"DATA_OF_RANK_{rank}", str(copy))
    recipe = recipe_file(tmp_path, folders["llama"])
    before = tree_checksum(tmp_path, skip=("cache", "launch.py"))
    done = _launch_two(tmp_path, recipe, per_rank, 29551 if "ratio" in per_rank else 29552)
    assert "slimkit/" not in done.stderr, done.stderr[-3000:]  # no traceback through slimkit's code
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and len(lines) == 1 and fragment in lines[0], done.stderr[-3000:]
    assert "failed (exitcode: 2)" in done.stderr  # each process exited 2, none aborted or hung
    assert tree_checksum(tmp_path, skip=("cache", "launch.py")) == before
