"""``slimkit recipe run`` under ``torchrun``: two CPU processes (gloo) train the token-budgeted ``lora`` stage on
shares of each global batch, only the main process writes, and the saved model equals a one-process run's within
float32 round-off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import slimkit
from slimkit.engine.processes import Processes, join_processes
from tests.recipes.test_recipes import tiny_recipe


def test_outside_a_launcher_a_run_is_one_main_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert join_processes() == Processes(0, 1) and Processes().main


@pytest.mark.slow  # two interpreters importing torch, transformers and peft under torchrun
def test_two_launched_processes_save_the_one_process_result(tmp_path, tiny_llama_dir):
    args = {"tokens": 3 * 4 * 32 - 5, "batch_size": 4, "seq_len": 32, "dropout": 0.0, "validation_windows": 2}
    raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0}, stages=[{"stage": "lora", "args": args}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    command += ["-m", "slimkit.cli.main", "recipe", "run", str(recipe), "--out", str(out), "--no-eval", "--no-dense"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "tiny-llama", "two"]  # no second writer's trace
    one = slimkit.run(raw, tmp_path / "one", evaluate=False, compare_dense=False)
    two = load_file(out / "model" / "model.safetensors")
    single = one.model.state_dict()
    for name, tensor in two.items():
        torch.testing.assert_close(tensor, single[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # two interpreters under torchrun, each loading the teacher beside the student
def test_two_fsdp_processes_distil_every_weight_to_the_one_process_result(tmp_path, tiny_llama_dir):
    prune = {"sequential": [{"stage": "prune_layer", "args": {"scorer": "activation"}}]}
    args = {"tokens": 3 * 4 * 32 - 5, "batch_size": 4, "seq_len": 32, "validation_windows": 2, "adapter": "none"}

    def recipe_of(sharding: str) -> dict:
        spread = {"sharding": sharding, "teacher_sharding": sharding}  # the teacher sharded too under fsdp
        return tiny_recipe(tiny_llama_dir, stages=[prune, {"stage": "distill", "args": {**args, **spread}}])

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(recipe_of("fsdp")))
    out = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534"]
    command += ["-m", "slimkit.cli.main", "recipe", "run", str(recipe), "--out", str(out), "--no-eval", "--no-dense"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml", "tiny-llama", "two"]  # no checkpoint left behind
    one = slimkit.run(recipe_of("none"), tmp_path / "one", evaluate=False, compare_dense=False)
    two = load_file(out / "model" / "model.safetensors")
    single = one.model.state_dict()
    assert set(two) <= set(single) and len(two) > 0
    for name, tensor in two.items():
        torch.testing.assert_close(tensor, single[name], rtol=1e-4, atol=1e-5, msg=name)
    assert one.report.as_json()["stages"]["distill"]["stopped"] is None
    report = json.loads((out / "report.json").read_text())["stages"]["distill"]
    assert report["teacher_sharded"] is True and report["sharding"] == "fsdp"  # the teacher sharded with the student
    assert one.report.as_json()["stages"]["distill"]["teacher_sharded"] is False
