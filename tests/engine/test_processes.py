"""Launched processes agree on their inputs before any work (:func:`slimkit.engine.processes.agree_on_inputs`) and no
collective waits forever: the digests and the disagreement line by hand, then two ``torchrun`` processes given
different recipes refusing together in one line, and a collective past its timeout failing in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from slimkit.engine.processes import collective_timeout, disagreement, input_digests
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.loading import load_recipe
from tests.recipes.test_recipes import tiny_recipe

AGREED = {"recipe": "r", "model": "m", "data": "d", "slimkit": "1"}


def test_processes_that_agree_say_nothing():
    assert disagreement([AGREED, dict(AGREED), dict(AGREED)]) is None


def test_the_first_part_that_differs_is_named_with_the_ranks():
    line = disagreement([AGREED, {**AGREED, "data": "x"}, {**AGREED, "model": "y", "data": "x"}, AGREED])
    assert line is not None and line.startswith("the 4 launched processes were given different inputs: the model's ")
    assert "weights of rank 2 differs from rank 0's (model y against m)" in line
    line = disagreement([AGREED, {**AGREED, "data": "x"}, {**AGREED, "data": "z"}])
    assert line is not None and "the data of ranks 1, 2 differs from rank 0's (data x against d)" in line


def _recipe(tmp_path: Path, model: Path, **changes) -> object:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(model, target={"ratio": 0}, **changes)))
    return load_recipe(str(path))[0]


def test_the_digests_follow_the_recipe_the_weights_and_the_data(tmp_path, tiny_llama_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text")
    lora = {"stage": "lora", "args": {"tokens": 64, "seq_len": 16, "batch_size": 2, "data_folder": str(data)}}
    first = input_digests(_recipe(tmp_path, tiny_llama_dir, stages=[lora]))
    assert input_digests(_recipe(tmp_path, tiny_llama_dir, stages=[lora])) == first
    other = input_digests(_recipe(tmp_path, tiny_llama_dir, stages=[lora], seed=1))
    assert other["recipe"] != first["recipe"] and other["model"] == first["model"]
    (data / "a.txt").write_text("other text")
    assert input_digests(_recipe(tmp_path, tiny_llama_dir, stages=[lora]))["data"] != first["data"]
    weights = tiny_llama_dir / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit in the middle of the weights
    weights.write_bytes(bytes(raw))
    assert input_digests(_recipe(tmp_path, tiny_llama_dir, stages=[lora]))["model"] != first["model"]


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_a_bad_collective_timeout_is_one_line(monkeypatch, value):
    monkeypatch.setenv("SLIMKIT_COLLECTIVE_TIMEOUT", value)
    with pytest.raises(SlimkitError, match=r"^SLIMKIT_COLLECTIVE_TIMEOUT: .* is not a number of seconds above 0$"):
        collective_timeout()
    monkeypatch.setenv("SLIMKIT_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout().total_seconds() == 12.5


def _launch(
    args: list[str], port: int, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    start = time.monotonic()
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def _slimkit_lines(stderr: str) -> list[str]:
    """The error lines slimkit's processes printed (torchrun adds its own report of a failed child); no traceback
    passed through slimkit's code."""
    assert "slimkit/" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow  # two interpreters under torchrun
def test_two_processes_given_different_recipes_refuse_together_in_one_line(tmp_path, tiny_llama_dir):
    for tokens in (512, 256):
        args = {"tokens": tokens, "batch_size": 4, "seq_len": 32, "dropout": 0.0, "validation_windows": 2}
        raw = tiny_recipe(tiny_llama_dir, target={"ratio": 0}, stages=[{"stage": "lora", "args": args}])
        (tmp_path / f"r{tokens}.yaml").write_text(yaml.safe_dump(raw))
    wrapper = tmp_path / "launch.py"
    wrapper.write_text(
        "import os, sys\n"
        f"tokens = '512' if os.environ['LOCAL_RANK'] == '0' else '256'\n"
        f"sys.argv = ['slimkit', 'recipe', 'run', {str(tmp_path)!r} + f'/r{{tokens}}.yaml', '--out', "
        f"{str(tmp_path / 'out')!r}, '--no-eval', '--no-dense']\n"
        "from slimkit.cli.main import main\nmain()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done, seconds = _launch([str(wrapper)], 29541, env, timeout=300)
    assert done.returncode != 0 and seconds < 120, (done.returncode, seconds)
    lines = _slimkit_lines(done.stderr)
    assert len(lines) == 1 and "the 2 launched processes were given different inputs: the recipe of rank 1" in lines[0]
    assert not (tmp_path / "out").exists() and "failed (exitcode: 2)" in done.stderr


@pytest.mark.slow  # two interpreters under torchrun
def test_a_collective_past_its_timeout_fails_in_one_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIMKIT_COLLECTIVE_TIMEOUT": "3"}
    worker = Path(__file__).with_name("collective_worker.py")
    done, seconds = _launch([str(worker)], 29542, env, timeout=120)
    assert done.returncode != 0 and seconds < 45, (done.returncode, seconds)
    lines = _slimkit_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: a collective among the 2 launched processes failed")
    assert "Timed out" in lines[0] and "SLIMKIT_COLLECTIVE_TIMEOUT (3 s)" in lines[0]
