"""The hostile-input suite (issue 28): inputs a careful attacker or a clumsy user would give, one table.

Every case builds its input in ``tmp_path`` from tiny random models, runs the CLI in-process and asserts one
``error:`` line naming what is wrong (exit status 2, no traceback), within a time bound (nothing spins or
blocks), and that the file tree under ``tmp_path`` is byte-for-byte what it was (nothing written, nothing
replaced, no partial file left). The class numbers are the issue's:

1. files slimkit did not write must not be clobbered (export half here);
2. no output is an input, inside one or a folder holding one (export half here);
3. a model must never be read wrong: exactly the weight files the checkpoint names, perplexity windows within
   the model's positions;
4. hangs and unbounded resources: YAML aliases and nesting, FIFOs and devices, sizes from input bounded by the
   weight files before anything is allocated;
5. bad input must not end in a traceback (YAML keys and tags, deep JSON, architectures, zero sizes,
   quantisation configs, ``--set`` paths), and what a run will write is proven writable and saveable before it
   computes (mount points, file names, export paths, seeds, recipe values);
6. unwritable targets (a device, a symbolic link, a file-size limit) are one line and damage nothing;
7. ``~`` is expanded by the Python API as by the CLI; SIGTERM during an export cleans its partial file.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import slimkit
from slimkit.engine.output_safety import RUN_MARKER
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.export import export
from slimkit.primitives.export.gguf_file import place_file
from slimkit.primitives.files import lock
from slimkit.primitives.io.model_sources import SOURCES, NamedSource
from tests.cli.test_cli import run_cli
from tests.contracts.hostile import (
    copy_model,
    edit_json,
    low_rank_model,
    nested_json,
    plain_model,
    recipe_file,
    sharded_model,
    tree_checksum,
    weights_of,
    write_weights,
)
from tests.recipes.test_recipes import tiny_recipe

TIME_LIMIT_S = 20.0
"""No refusal may take longer (a billion-laughs document or a FIFO would take forever)."""


class Models(NamedTuple):
    plain: Path
    sharded: Path
    low_rank: Path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("templates")
    return Models(plain_model(root), sharded_model(root), low_rank_model(root))


Build = Callable[[Path, Models], list[str]]


class Case(NamedTuple):
    id: str
    cls: int
    build: Build
    fragment: str


# --- class 3: read exactly the weight files the checkpoint names --------------------------------------------


def stray_weights_copy(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    stray = {k: torch.zeros_like(v) for k, v in weights_of(folder / "model.safetensors").items()}
    write_weights(folder / "backup.safetensors", stray)
    return ["inspect", str(folder)]


def stray_shard_beside_index(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.sharded, tmp)
    first = sorted(folder.glob("model-*.safetensors"))[0]
    write_weights(folder / "model-extra.safetensors", weights_of(first))
    return ["eval", str(folder), "--json", str(tmp / "r.json")]


def tensor_in_two_shards(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.sharded, tmp)
    shards = sorted(folder.glob("model-*.safetensors"))
    first, second = weights_of(shards[0]), weights_of(shards[1])
    name = next(iter(first))
    write_weights(shards[1], {**second, name: torch.zeros_like(first[name])})
    return ["export", str(folder), "--out", str(tmp / "m.gguf")]


def index_names_a_path_outside(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.sharded, tmp)
    edit_json(
        folder / "model.safetensors.index.json",
        lambda d: d["weight_map"].update({"lm_head.weight": "../elsewhere/model.safetensors"}),
    )
    return ["inspect", str(folder)]


def index_puts_tensor_in_wrong_shard(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.sharded, tmp)
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    crowded = next(f for f in files if list(weight_map.values()).count(f) > 1)  # still named after the move
    name = next(k for k, v in weight_map.items() if v == crowded)
    other = next(f for f in files if f != crowded)
    edit_json(index, lambda d: d["weight_map"].update({name: other}))
    return ["inspect", str(folder)]


def two_shard_indexes(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.sharded, tmp)
    index = folder / "model.safetensors.index.json"
    (folder / "slimkit-model.safetensors.index.json").write_text(index.read_text())
    return ["inspect", str(folder)]


def weight_missing_from_files(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    tensors = weights_of(folder / "model.safetensors")
    del tensors["model.norm.weight"]
    write_weights(folder / "model.safetensors", tensors)
    return ["recipe", "run", str(recipe_file(tmp)), "--model", str(folder), "--out", str(tmp / "out")]


def config_has_fewer_layers_than_weights(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_hidden_layers=2))
    return ["eval", str(folder)]


# --- class 4: bounded input, nothing blocks ------------------------------------------------------------------


def billion_laughs(tmp: Path, m: Models) -> list[str]:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp / "laughs.yaml"
    path.write_text("\n".join(lines) + "\nname: *a8\n")
    assert path.stat().st_size < 1100
    return ["recipe", "validate", str(path)]


def recursive_alias(tmp: Path, m: Models) -> list[str]:
    path = tmp / "loop.yaml"
    path.write_text("name: x\nstages: &s [{sequential: *s}]\n")
    return ["recipe", "validate", str(path)]


def recipe_nested_deep(tmp: Path, m: Models) -> list[str]:
    path = tmp / "deep.yaml"
    path.write_text("name: x\nstages: " + "[" * 3000 + "]" * 3000 + "\n")
    return ["recipe", "validate", str(path)]


def recipe_too_large(tmp: Path, m: Models) -> list[str]:
    path = tmp / "huge.yaml"
    path.write_text("name: x\n" + "# padding\n" * 120_000)
    return ["recipe", "validate", str(path)]


def fifo_weights(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    return ["inspect", str(folder)]


def fifo_config(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (folder / "generation_config.json").unlink(missing_ok=True)
    os.mkfifo(folder / "generation_config.json")
    return ["eval", str(folder)]


def device_as_weights(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("/dev/zero")
    return ["export", str(folder), "--out", str(tmp / "m.gguf")]


def fifo_recipe(tmp: Path, m: Models) -> list[str]:
    os.mkfifo(tmp / "recipe.yaml")
    return ["recipe", "validate", str(tmp / "recipe.yaml")]


def fifty_million_layers(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_hidden_layers=50_000_000))
    return ["inspect", str(folder)]


def absurd_vocabulary(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.low_rank, tmp)
    edit_json(folder / "config.json", lambda c: c.update(vocab_size=10**12))
    return ["inspect", str(folder)]


def absurd_hidden_size(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(intermediate_size=2**40))
    return ["eval", str(folder)]


def absurd_rank_in_manifest(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.low_rank, tmp)
    edit_json(folder / "slimkit_manifest.json", lambda d: d["modules"][0].update(rank=10**9))
    return ["inspect", str(folder)]


# --- class 5: no traceback on bad input ----------------------------------------------------------------------


def _recipe_text(tmp: Path, m: Models, extra: str) -> list[str]:
    path = recipe_file(tmp, m.plain)
    path.write_text(path.read_text() + extra)
    return ["recipe", "validate", str(path)]


def integer_key(tmp: Path, m: Models) -> list[str]:
    return _recipe_text(tmp, m, "1: one\n")


def null_key(tmp: Path, m: Models) -> list[str]:
    return _recipe_text(tmp, m, "~: nothing\n")


def duplicate_key(tmp: Path, m: Models) -> list[str]:
    return _recipe_text(tmp, m, "seed: 7\n")


def timestamp_value(tmp: Path, m: Models) -> list[str]:
    return _recipe_text(tmp, m, "description: 2026-11-26\n")


def binary_tag(tmp: Path, m: Models) -> list[str]:
    return _recipe_text(tmp, m, "description: !!binary aGVsbG8=\n")


def non_ascii_digit_in_set(tmp: Path, m: Models) -> list[str]:
    return ["recipe", "validate", str(recipe_file(tmp, m.plain)), "--set", "stages.\u00b2.args.scorer=magnitude"]


def config_nested_deep(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (folder / "config.json").write_text(nested_json(5000))
    return ["inspect", str(folder)]


def generation_config_nested_deep(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (folder / "generation_config.json").write_text(nested_json(100))
    return ["eval", str(folder)]


def foreign_architecture(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    return ["inspect", str(folder)]


def architecture_not_a_class(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(architectures=["pipeline"]))
    return ["recipe", "run", str(recipe_file(tmp)), "--model", str(folder), "--out", str(tmp / "out")]


def zero_heads(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(num_attention_heads=0))
    return ["inspect", str(folder)]


def fractional_hidden_size(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.low_rank, tmp)
    edit_json(folder / "config.json", lambda c: c.update(hidden_size=47.5))
    return ["eval", str(folder)]


def quantization_config(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    return ["export", str(folder), "--out", str(tmp / "m.gguf")]


# --- class 1 (export): --force replaces only what slimkit export wrote ---------------------------------------


def force_over_project_folder(tmp: Path, m: Models) -> list[str]:
    project = tmp / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"model_type": "llama"}')
    (project / "thesis.tex").write_text("\\documentclass{article}")
    return ["export", str(m.plain), "--out", str(project), "--format", "hf", "--force"]


def force_over_export_with_user_file(tmp: Path, m: Models) -> list[str]:
    out = tmp / "hf"
    export(m.plain, out, "hf", verify=False)
    (out / "notes.txt").write_text("mine")
    return ["export", str(m.plain), "--out", str(out), "--format", "hf", "--force"]


def out_is_a_symlink(tmp: Path, m: Models) -> list[str]:
    (tmp / "precious.gguf").write_bytes(b"GGUF precious")
    (tmp / "m.gguf").symlink_to(tmp / "precious.gguf")
    return ["export", str(m.plain), "--out", str(tmp / "m.gguf"), "--force"]


def export_already_running(tmp: Path, m: Models) -> list[str]:
    _HELD.append(lock.acquire_lock(tmp / "m.gguf"))  # as another export would hold it (released after the case)
    return ["export", str(m.plain), "--out", str(tmp / "m.gguf")]


_HELD: list[lock.SiblingLock] = []


# --- class 2: no output is an input, inside one, or a folder holding one --------------------------------------


def export_over_its_input(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return ["export", str(folder), "--out", str(folder), "--format", "hf", "--force"]


def export_into_its_input(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return ["export", str(folder), "--out", str(folder / "model.gguf")]


def export_over_a_parent_of_its_input(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp / "project")
    return ["export", str(folder), "--out", str(tmp / "project"), "--format", "hf", "--force"]


def export_through_a_link_to_its_input(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    (tmp / "alias").symlink_to(folder)
    return ["export", str(tmp / "alias"), "--out", str(folder / "tokenizer.json"), "--force"]


def export_over_the_root(tmp: Path, m: Models) -> list[str]:
    return ["export", str(m.plain), "--out", "/", "--format", "hf", "--force"]


def _run(tmp: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["recipe", "run", str(recipe_file(tmp, model)), "--model", str(model), "--out", str(out), *extra]


def run_over_its_model(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return _run(tmp, folder, folder, "--force")


def run_into_its_model(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return _run(tmp, folder, folder / "compressed")


def run_over_a_parent_of_its_model(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp / "work")
    return _run(tmp, folder, tmp / "work", "--force")


def eval_json_inside_the_model(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return ["eval", str(folder), "--json", str(folder / "config.json")]


def eval_json_new_file_in_the_model(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.plain, tmp)
    return ["eval", str(folder), "--json", str(folder / "results.json")]


# --- class 1 (recipe run): locks and --force ---------------------------------------------------------------


def lock_is_a_symlink(tmp: Path, m: Models) -> list[str]:
    (tmp / "victim.txt").write_text("the user's file")
    (tmp / ".out.lock").symlink_to(tmp / "victim.txt")
    return _run(tmp, m.plain, tmp / "out")


def lock_named_user_file(tmp: Path, m: Models) -> list[str]:
    (tmp / ".out.lock").write_text("my notes, named oddly")
    return _run(tmp, m.plain, tmp / "out")


def force_over_a_folder_with_a_report(tmp: Path, m: Models) -> list[str]:
    out = tmp / "project"
    out.mkdir()
    (out / "report.json").write_text("{}")
    (out / "thesis.tex").write_text("\\documentclass{article}")
    return _run(tmp, m.plain, out, "--force")


def force_over_a_run_with_a_user_file(tmp: Path, m: Models) -> list[str]:
    out = tmp / "out"
    (out / "model").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    (out / RUN_MARKER).write_text(json.dumps({"files": ["model", "report.json", "report.md"]}))
    (out / "notes.txt").write_text("mine")
    return _run(tmp, m.plain, out, "--force")


# --- class 5 (before compute): what a run will write is proven writable and saveable ------------------------


def out_is_a_mount_point(tmp: Path, m: Models) -> list[str]:
    return _run(tmp, m.plain, Path("/proc"), "--force")


def export_path_with_nul(tmp: Path, m: Models) -> list[str]:
    path = recipe_file(tmp, m.plain)
    path.write_text(path.read_text() + 'export: [{path: "export/a\\0b.gguf"}]\n')
    return ["recipe", "validate", str(path)]


def export_name_too_long(tmp: Path, m: Models) -> list[str]:
    return ["export", str(m.plain), "--out", str(tmp / ("m" * 300 + ".gguf"))]


def export_path_inside_model(tmp: Path, m: Models) -> list[str]:
    return ["recipe", "validate", str(recipe_file(tmp, m.plain)), "--set", "export=[{path: model/m.gguf}]"]


def seed_beyond_64_bits(tmp: Path, m: Models) -> list[str]:
    return ["recipe", "validate", str(recipe_file(tmp, m.plain)), "--set", f"seed={2**70}"]


def endless_calibration(tmp: Path, m: Models) -> list[str]:
    return [
        "recipe",
        "validate",
        str(recipe_file(tmp, m.plain)),
        "--set",
        "calibration.samples=10000000000000000000000000",
    ]


def eval_window_beyond_positions(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(m.plain), "--seq-len", "100000", "--max-tokens", "0"]


def _added_tokens(tmp: Path, m: Models, count: int = 3) -> Path:
    """A plain model whose tokenizer gained ``count`` tokens the embedding has no rows for."""
    from transformers import AutoTokenizer

    folder = copy_model(m.plain, tmp)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([f"<extra-{i}>" for i in range(count)])
    tokenizer.save_pretrained(folder)
    return folder


def tokenizer_beyond_vocabulary_eval(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(_added_tokens(tmp, m))]


def tokenizer_beyond_vocabulary_run(tmp: Path, m: Models) -> list[str]:
    return _run(tmp, _added_tokens(tmp, m, 1), tmp / "out")


def tokenizer_id_far_beyond_vocabulary(tmp: Path, m: Models) -> list[str]:
    folder = copy_model(m.low_rank, tmp)
    edit_json(folder / "tokenizer.json", lambda t: t["model"]["vocab"].update({"zzz": 10**6}))
    return ["eval", str(folder), "--json", str(tmp / "r.json")]


def max_memory_beyond_any_machine(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(m.plain), "--max-memory", "1e40GiB"]


def max_memory_of_400_digits(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(m.plain), "--max-memory", "9" * 400]


def max_memory_negative(tmp: Path, m: Models) -> list[str]:
    return _run(tmp, m.plain, tmp / "out", "--max-memory", "-1")


def max_memory_infinite_in_recipe(tmp: Path, m: Models) -> list[str]:
    return ["recipe", "validate", str(recipe_file(tmp, m.plain)), "--set", "model.max_memory=inf"]


def max_memory_of_400_digits_in_recipe(tmp: Path, m: Models) -> list[str]:
    return ["recipe", "validate", str(recipe_file(tmp, m.plain)), "--set", "model.max_memory=" + "9" * 400]


GGUF_SOURCE = "hostile-gguf"
"""A named GGUF model source registered for one case (its package a folder under ``tmp``, its cache too)."""


def _gguf_source(tmp: Path) -> Path:
    """Register :data:`GGUF_SOURCE` (undone after the case) and return the cache folder its conversion writes."""
    import importlib

    packages, cache = tmp / "packages", tmp / "cache"
    (packages / "hostile_gguf_source").mkdir(parents=True)
    (packages / "hostile_gguf_source" / "model.gguf").write_bytes(b"GGUF never read: refused before")
    (cache / "models").mkdir(parents=True)
    SOURCES[GGUF_SOURCE] = NamedSource(GGUF_SOURCE, "hostile_gguf_source", "none", "a test", gguf_file="model.gguf")
    sys.path.insert(0, str(packages))
    importlib.invalidate_caches()
    previous_cache = os.environ.get("SLIMKIT_CACHE_DIR")
    os.environ["SLIMKIT_CACHE_DIR"] = str(cache)

    def undo() -> None:
        SOURCES.pop(GGUF_SOURCE, None)
        sys.path.remove(str(packages))
        if previous_cache is None:
            os.environ.pop("SLIMKIT_CACHE_DIR", None)
        else:
            os.environ["SLIMKIT_CACHE_DIR"] = previous_cache

    _UNDO.append(undo)
    return cache / "models" / GGUF_SOURCE


def cache_conversion_running(tmp: Path, m: Models) -> list[str]:
    _HELD.append(lock.acquire_lock(_gguf_source(tmp)))  # as another process converting it would hold it
    return ["eval", GGUF_SOURCE]


def cache_folder_is_a_symlink(tmp: Path, m: Models) -> list[str]:
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "mine.txt").write_text("the user's file")
    _gguf_source(tmp).symlink_to(tmp / "elsewhere")
    return ["eval", GGUF_SOURCE]


def cache_folder_of_user_files(tmp: Path, m: Models) -> list[str]:
    folder = _gguf_source(tmp)
    folder.mkdir()
    (folder / "notes.txt").write_text("not a conversion")
    return ["recipe", "run", str(recipe_file(tmp, GGUF_SOURCE)), "--out", str(tmp / "out")]


def cache_lock_is_a_symlink(tmp: Path, m: Models) -> list[str]:
    folder = _gguf_source(tmp)
    (tmp / "victim.txt").write_text("the user's file")
    lock.lock_path(folder).symlink_to(tmp / "victim.txt")
    return ["eval", GGUF_SOURCE]


_UNDO: list[Callable[[], None]] = []


def _short_context(tmp: Path, m: Models, positions: int) -> Path:
    folder = copy_model(m.plain, tmp)
    edit_json(folder / "config.json", lambda c: c.update(max_position_embeddings=positions))
    return folder


def zeroshot_choice_beyond_context(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(_short_context(tmp, m, 4)), "--ppl", "", "--zeroshot", "hellaswag", "--limit", "2"]


def zeroshot_choice_beyond_context_json(tmp: Path, m: Models) -> list[str]:
    folder = _short_context(tmp, m, 2)
    return ["eval", str(folder), "--ppl", "", "--zeroshot", "piqa", "--limit", "2", "--json", str(tmp / "r.json")]


# --- class 6: unwritable targets ---------------------------------------------------------------------------


def eval_json_to_a_device(tmp: Path, m: Models) -> list[str]:
    return ["eval", str(m.plain), "--json", "/dev/full"]


def export_under_a_file(tmp: Path, m: Models) -> list[str]:
    (tmp / "notes.txt").write_text("a file, not a folder")
    return ["export", str(m.plain), "--out", str(tmp / "notes.txt" / "m.gguf")]


def run_under_a_file(tmp: Path, m: Models) -> list[str]:
    (tmp / "notes.txt").write_text("a file, not a folder")
    return _run(tmp, m.plain, tmp / "notes.txt" / "out")


def eval_json_through_a_symlink(tmp: Path, m: Models) -> list[str]:
    (tmp / "precious.json").write_text("{}")
    (tmp / "r.json").symlink_to(tmp / "precious.json")
    return ["eval", str(m.plain), "--json", str(tmp / "r.json")]


CASES = [
    Case("stray-weights-copy", 3, stray_weights_copy, "holds 2 weight files (backup.safetensors, model.safetensors)"),
    Case("stray-shard-beside-index", 3, stray_shard_beside_index, "model-extra.safetensors is a weights file"),
    Case("tensor-in-two-shards", 3, tensor_in_two_shards, "holds too; each tensor must be in one weight file"),
    Case("index-names-path-outside", 3, index_names_a_path_outside, "which is not a .safetensors file name"),
    Case("index-wrong-shard", 3, index_puts_tensor_in_wrong_shard, "but model-0000"),
    Case("two-shard-indexes", 3, two_shard_indexes, "holds 2 shard indexes"),
    Case("weight-missing-from-files", 3, weight_missing_from_files, "builds model.norm.weight, which no weight file"),
    Case("fewer-layers-than-weights", 3, config_has_fewer_layers_than_weights, "num_hidden_layers 2 disagrees"),
    Case("billion-laughs", 4, billion_laughs, "expands to more than 100,000 values"),
    Case("recursive-alias", 4, recursive_alias, "an alias refers to a value that contains it"),
    Case("recipe-nested-deep", 4, recipe_nested_deep, "nested more than 32 levels deep"),
    Case("recipe-too-large", 4, recipe_too_large, "more than the 1024 KiB a recipe may hold"),
    Case("fifo-weights", 4, fifo_weights, "model.safetensors is a FIFO (named pipe), not a regular file"),
    Case("fifo-generation-config", 4, fifo_config, "generation_config.json is a FIFO"),
    Case("device-as-weights", 4, device_as_weights, "model.safetensors is a character device"),
    Case("fifo-recipe", 4, fifo_recipe, "is not a regular file"),
    Case("fifty-million-layers", 4, fifty_million_layers, "num_hidden_layers 50000000 disagrees with the weights"),
    Case("absurd-vocabulary", 4, absurd_vocabulary, "vocab_size 1000000000000 is larger than any dimension"),
    Case("absurd-mlp-width", 4, absurd_hidden_size, "intermediate_size 1099511627776 is larger than any dimension"),
    Case("absurd-rank", 4, absurd_rank_in_manifest, "rank 1000000000 larger than any dimension"),
    Case("integer-key", 5, integer_key, "key '1' is not a string (!!int)"),
    Case("null-key", 5, null_key, "key '~' is not a string (!!null)"),
    Case("duplicate-key", 5, duplicate_key, "key 'seed' appears twice in one mapping"),
    Case("timestamp-value", 5, timestamp_value, "!!timestamp value '2026-11-26'"),
    Case("binary-tag", 5, binary_tag, "!!binary value"),
    Case("non-ascii-digit-in-set", 5, non_ascii_digit_in_set, "is not an index of a list of 1"),
    Case("config-nested-deep", 5, config_nested_deep, "config.json: nested more than 32 levels deep"),
    Case("generation-config-deep", 5, generation_config_nested_deep, "generation_config.json: nested more than 32"),
    Case("foreign-architecture", 5, foreign_architecture, "names 'GPT2LMHeadModel', which is not a transformers"),
    Case("architecture-not-a-class", 5, architecture_not_a_class, "names 'pipeline', which is not a transformers"),
    Case("zero-heads", 5, zero_heads, "num_attention_heads must be a positive integer, got 0"),
    Case("fractional-hidden-size", 5, fractional_hidden_size, "hidden_size must be a positive integer, got 47.5"),
    Case("quantization-config", 5, quantization_config, "quantization_config (quant_method gptq)"),
    Case("force-over-project-folder", 1, force_over_project_folder, "was not written by slimkit export"),
    Case("force-over-user-file", 1, force_over_export_with_user_file, "holds notes.txt, which slimkit export did not"),
    Case("out-is-a-symlink", 1, out_is_a_symlink, "is a symbolic link; slimkit never writes through one"),
    Case("export-already-running", 1, export_already_running, "is being written by another slimkit export (pid"),
    Case("export-over-root", 1, export_over_the_root, "is the filesystem root, which an export never replaces"),
    Case("export-over-its-input", 2, export_over_its_input, "is the input"),
    Case("export-into-its-input", 2, export_into_its_input, "is inside the input"),
    Case("export-over-input-parent", 2, export_over_a_parent_of_its_input, "is a folder holding the input"),
    Case("export-through-link", 2, export_through_a_link_to_its_input, "is inside the input"),
    Case("run-over-its-model", 2, run_over_its_model, "is the input"),
    Case("run-into-its-model", 2, run_into_its_model, "is inside the input"),
    Case("run-over-model-parent", 2, run_over_a_parent_of_its_model, "is a folder holding the input"),
    Case("eval-json-over-config", 2, eval_json_inside_the_model, "config.json is inside the input"),
    Case("eval-json-into-model", 2, eval_json_new_file_in_the_model, "is inside the input"),
    Case("lock-is-a-symlink", 1, lock_is_a_symlink, ".out.lock is a symbolic link where slimkit keeps its lock"),
    Case("lock-named-user-file", 1, lock_named_user_file, ".out.lock is not a slimkit lock file"),
    Case("force-over-report-folder", 1, force_over_a_folder_with_a_report, "project is not a slimkit output"),
    Case("force-over-run-and-notes", 1, force_over_a_run_with_a_user_file, "holds notes.txt, which slimkit did not"),
    Case("out-is-a-mount-point", 5, out_is_a_mount_point, "is a mount point"),
    Case("export-path-with-nul", 5, export_path_with_nul, "holds a NUL byte or a name longer than 255 bytes"),
    Case("export-name-too-long", 5, export_name_too_long, "a file name is at most 255 bytes, this one 305"),
    Case("export-path-inside-model", 5, export_path_inside_model, "is in the run's own model"),
    Case("seed-beyond-64-bits", 5, seed_beyond_64_bits, "seed: "),
    Case("endless-calibration", 4, endless_calibration, "calibration.samples: "),
    Case("eval-window-beyond-positions", 3, eval_window_beyond_positions, "--seq-len: 100000 is longer than"),
    Case("tokenizer-beyond-vocab-eval", 5, tokenizer_beyond_vocabulary_eval, "has token ids up to"),
    Case("tokenizer-beyond-vocab-run", 5, tokenizer_beyond_vocabulary_run, "but the model's embedding has"),
    Case("tokenizer-id-far-beyond-vocab", 5, tokenizer_id_far_beyond_vocabulary, "ids up to 1000000 ('zzz')"),
    Case("max-memory-1e40GiB", 5, max_memory_beyond_any_machine, "max_memory: expected a size like 20GiB"),
    Case("max-memory-400-digits", 5, max_memory_of_400_digits, "(400 characters) is larger than 1024 TiB"),
    Case("max-memory-negative", 5, max_memory_negative, "max_memory"),
    Case("max-memory-inf-in-recipe", 5, max_memory_infinite_in_recipe, "model.max_memory"),
    Case("max-memory-digits-in-recipe", 5, max_memory_of_400_digits_in_recipe, "is larger than 1024 TiB"),
    Case("cache-conversion-running", 1, cache_conversion_running, "is being converted by another process (pid"),
    Case("cache-folder-is-a-symlink", 1, cache_folder_is_a_symlink, "is a symbolic link to no converted model"),
    Case("cache-folder-of-user-files", 1, cache_folder_of_user_files, "exists without a config.json"),
    Case("cache-lock-is-a-symlink", 1, cache_lock_is_a_symlink, "is a symbolic link where slimkit keeps its lock"),
    Case("zeroshot-choice-beyond-context", 3, zeroshot_choice_beyond_context, "longer than the model's context of 4"),
    Case("zeroshot-choice-beyond-ctx-json", 3, zeroshot_choice_beyond_context_json, "zero-shot task piqa: a choice is"),
    Case("eval-json-to-a-device", 6, eval_json_to_a_device, "/dev/full is not a regular file"),
    Case("export-under-a-file", 6, export_under_a_file, "notes.txt is a file, not a folder"),
    Case("run-under-a-file", 6, run_under_a_file, "notes.txt is a file, not a folder"),
    Case("eval-json-through-a-symlink", 6, eval_json_through_a_symlink, "is a symbolic link; slimkit never writes"),
]


class _Blocked(Exception):
    pass


def _alarm(_signum, _frame):
    raise _Blocked("the command blocked")


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_hostile_input_is_refused_in_one_line(case, models, monkeypatch, capsys, tmp_path):
    args = case.build(tmp_path, models)
    before = tree_checksum(tmp_path)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(TIME_LIMIT_S) * 3)  # a FIFO opened by mistake would block forever: fail instead
    start = time.monotonic()
    try:
        code, out, err = run_cli(monkeypatch, capsys, *args)
        elapsed = time.monotonic() - start
        after = tree_checksum(tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        while _HELD:
            _HELD.pop().release()
    assert code == 2, (code, err)
    assert "Traceback" not in err + out, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.fragment in lines[0], lines[0]
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.1f} s"
    assert after == before


def test_the_table_covers_each_class_with_several_cases():
    per_class: dict[int, int] = {}
    for case in CASES:
        per_class[case.cls] = per_class.get(case.cls, 0) + 1
    assert len({case.id for case in CASES}) == len(CASES)
    assert all(count >= 3 for count in per_class.values()), per_class


# --- the Python API reads and writes by the same rules -------------------------------------------------------


def test_load_refuses_a_stray_weights_file_and_expands_home(models, tmp_path, monkeypatch):
    folder = copy_model(models.plain, tmp_path / "home")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model, _ = slimkit.load("~/model")
    assert model.config.model_type == "llama"
    write_weights(folder / "zz-stray.safetensors", weights_of(folder / "model.safetensors"))
    with pytest.raises(SlimkitError, match="holds 2 weight files"):
        slimkit.load("~/model")


def _save_through_a_link(tmp: Path) -> tuple[Path, type[Exception], str]:
    (tmp / "elsewhere").mkdir()
    (tmp / "out").symlink_to(tmp / "elsewhere")
    return tmp / "out", SlimkitError, "is a symbolic link; slimkit never writes through one"


def _save_while_another_saves(tmp: Path) -> tuple[Path, type[Exception], str]:
    _HELD.append(lock.acquire_lock(tmp / "out"))
    return tmp / "out", lock.LockHeld, r"out is being written by another process \(pid \d+\)"


def _save_with_a_linked_lock(tmp: Path) -> tuple[Path, type[Exception], str]:
    (tmp / "victim.txt").write_text("the user's file")
    lock.lock_path(tmp / "out").symlink_to(tmp / "victim.txt")
    return tmp / "out", SlimkitError, "is a symbolic link where slimkit keeps its lock"


@pytest.mark.parametrize("build", [_save_through_a_link, _save_while_another_saves, _save_with_a_linked_lock])
def test_save_takes_the_lock_and_never_writes_through_a_link(build, models, tmp_path):
    """``slimkit.save`` follows the output rules of every command that writes: one writer per folder (the lock),
    never through a symbolic link (the folder's or the lock's); refused in one line with the tree unchanged."""
    model, tokenizer = slimkit.load(models.plain)
    target, error, message = build(tmp_path)
    before = tree_checksum(tmp_path)
    try:
        with pytest.raises(error, match=message) as raised:
            slimkit.save(model, tokenizer, target)
        after = tree_checksum(tmp_path)  # before the other writer's lock is released
    finally:
        while _HELD:
            _HELD.pop().release()
    assert len(str(raised.value).splitlines()) == 1
    assert after == before
    if build is _save_while_another_saves:
        assert list(tmp_path.iterdir()) == []
        slimkit.save(model, tokenizer, target)  # once the other writer is gone, the save goes through
        assert (target / "config.json").is_file() and not lock.lock_path(target).exists()


@pytest.mark.parametrize(
    "budget", ["1e40GiB", -1, "-1", "inf", float("inf"), float("nan"), "9" * 400, 10**400, 1e300, "1025TiB", True]
)
def test_load_refuses_an_overflowing_memory_budget_in_one_line(budget, models, tmp_path, monkeypatch):
    """``slimkit.load(max_memory=...)`` bounds the budget as ``--max-memory`` and ``model.max_memory`` do: one
    :class:`SlimkitError` line naming the field, before the folder is read (nothing written to the cache)."""
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SlimkitError, match=r"^max_memory: ") as raised:
        slimkit.load(models.plain, max_memory=budget)
    assert len(str(raised.value).splitlines()) == 1 and len(str(raised.value)) < 200
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_folder_loads_from_exactly_its_shards(models):
    model, _ = slimkit.load(models.sharded)
    reference, _ = slimkit.load(models.plain)
    assert set(model.state_dict()) == set(reference.state_dict())


def test_without_force_an_export_never_replaces_a_file_that_appeared(tmp_path):
    target, staging = tmp_path / "m.gguf", tmp_path / ".m.gguf.partial"
    target.write_bytes(b"GGUF another export's file")
    staging.write_bytes(b"GGUF this export")
    with pytest.raises(SlimkitError, match="appeared while this export ran"):
        place_file(staging, target, replace=False)
    assert target.read_bytes() == b"GGUF another export's file"
    place_file(staging, tmp_path / "new.gguf", replace=False)
    assert (tmp_path / "new.gguf").read_bytes() == b"GGUF this export" and not staging.exists()


def test_force_replaces_an_earlier_export_and_its_marker_lists_every_file(models, tmp_path):
    out = tmp_path / "hf"
    export(models.plain, out, "hf", verify=False)
    marker = json.loads((out / ".slimkit-export.json").read_text())
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {".slimkit-export.json"}
    export(models.plain, out, "hf", force=True, verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    gguf = tmp_path / "m.gguf"
    export(models.plain, gguf)
    assert gguf.read_bytes()[:4] == b"GGUF"


def test_sigterm_during_an_export_deletes_its_partial_file(models, tmp_path, monkeypatch):
    """SIGTERM while the GGUF is being written: the export stops like Ctrl-C and leaves nothing beside --out."""
    import gguf

    write = gguf.GGUFWriter.write_tensors_to_file

    def terminated_midway(self, *args, **kwargs):
        assert any(p.name.startswith(".m.gguf.partial-") for p in tmp_path.iterdir())
        os.kill(os.getpid(), signal.SIGTERM)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", terminated_midway)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        export(models.plain, tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


FILE_SIZE_LIMIT = 48 * 1024
"""Bytes a process may write to one file in the file-size-limit tests (the tiny model's weights are larger)."""


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["export-gguf", "export-hf", "recipe-run"])
def test_a_file_size_limit_while_writing_is_one_line_and_damages_nothing(kind, models, tmp_path):
    """Class 6: a write that fails (here RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) is one line, exit 2, and
    leaves the tree as it was: no partial file or folder, no lock."""
    args = {
        "export-gguf": ["export", str(models.plain), "--out", str(tmp_path / "m.gguf"), "--type", "f32"],
        "export-hf": ["export", str(models.plain), "--out", str(tmp_path / "hf"), "--format", "hf"],
        "recipe-run": _run(tmp_path, models.plain, tmp_path / "out", "--no-eval", "--no-dense"),
    }[kind]
    before = tree_checksum(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "slimkit.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=_limit_file_size,
        timeout=600,
        check=False,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:], result.stderr  # after a run's progress lines, one error line and nothing else
    assert "cannot write" in errors[0] and "nothing was replaced" in errors[0], errors[0]
    assert any(reason in errors[0] for reason in ("File too large", "a full disk or a file-size limit")), errors[0]
    assert tree_checksum(tmp_path) == before


def test_run_expands_home_in_out(models, tmp_path, monkeypatch):
    """Class 7: ``slimkit.run(out="~/x")`` writes under the home folder, never a literal ``./~``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    recipe = tiny_recipe(models.plain)
    slimkit.run(recipe, out="~/x", evaluate=False)
    assert (tmp_path / "home" / "x" / "report.json").is_file() and not (tmp_path / "~").exists()
    marker = json.loads((tmp_path / "home" / "x" / RUN_MARKER).read_text())
    everything = {p.relative_to(tmp_path / "home" / "x").as_posix() for p in (tmp_path / "home" / "x").rglob("*")}
    assert {*marker["files"], *marker["folders"]} == everything - {RUN_MARKER}


def test_a_recipe_value_recipe_yaml_cannot_hold_is_refused_before_loading(models, tmp_path):
    """Class 5 (after compute before this fix): a numpy scalar from the Python API validates but cannot be saved."""
    import numpy

    recipe = tiny_recipe(models.plain)
    recipe["target"]["ratio"] = numpy.float64(0.25)
    with pytest.raises(SlimkitError, match=r"recipe target.ratio: a numpy.float64 \(0.25\) cannot be saved"):
        slimkit.run(recipe, out=tmp_path / "out", evaluate=False)
    assert list(tmp_path.iterdir()) == []


def test_intact_models_of_every_kind_still_load(models):
    for folder in models:
        model, tokenizer = slimkit.load(folder)
        assert tokenizer is not None and isinstance(model, torch.nn.Module)
