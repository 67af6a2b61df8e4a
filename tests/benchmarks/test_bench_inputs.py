"""The benchmark entry points hold their inputs and outputs to the CLI's rules (benchmarks/inputs.py).

Each case runs ``benchmarks.run`` or ``benchmarks.glue_grid`` in-process and asserts one ``error:`` line, exit
status 2, within a time bound, and an unchanged file tree under the test's folder.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from benchmarks import glue_grid, glue_rows
from benchmarks import run as bench_run
from benchmarks.core.errors import BenchError
from benchmarks.core.inputs import read_json_file, read_yaml_file
from benchmarks.core.outputs import check_folder_option
from benchmarks.core.processes import OFFLINE_ENV, QUIET_ENV
from benchmarks.grid import load_grid
from benchmarks.grid_rows import ROW_FILE
from tests.contracts.hostile import tree_checksum

TIME_LIMIT_S = 20.0
GRID = "grid: [{recipe: a, ratios: [0.2]}]\nquick: {grid: [{recipe: a}]}\n"


@pytest.fixture(autouse=True)
def bench_env(monkeypatch, tmp_path):
    """The environment the entry points set (so it does not leak into other tests), run from ``tmp_path/work``."""
    for key, value in {**OFFLINE_ENV, **QUIET_ENV}.items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)


def one_line(capsys, tmp_path: Path, main, argv: list[str], fragment: str) -> str:
    before = tree_checksum(tmp_path)
    start = time.monotonic()
    code = main(argv)
    assert time.monotonic() - start < TIME_LIMIT_S
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert "Traceback" not in err
    assert tree_checksum(tmp_path) == before
    return lines[0]


def grid_file(tmp_path: Path, text: str, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- grid files through the bounded YAML loader ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("grid: " + "[" * 200 + "]" * 200 + "\n", "nested more than 32 levels deep"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
            "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
            "expands to more than",
        ),
        ("grid: [{recipe: a}]\ngrid: [{recipe: b}]\n", "appears twice"),
        ("grid: !!binary aGVsbG8=\n", "!!binary"),
    ],
    ids=["deep", "aliases", "duplicate-key", "binary-tag"],
)
def test_a_hostile_grid_file_is_one_line(capsys, tmp_path, text, fragment):
    path = grid_file(tmp_path, text)
    one_line(capsys, tmp_path, bench_run.main, ["--grid", str(path), "--list"], fragment)


def test_a_fifo_grid_file_is_one_line_without_blocking(capsys, tmp_path):
    os.mkfifo(tmp_path / "grid.yaml")
    one_line(capsys, tmp_path, bench_run.main, ["--grid", str(tmp_path / "grid.yaml"), "--list"], "a FIFO")


def test_a_claims_from_cycle_is_one_line(capsys, tmp_path):
    grid_file(tmp_path, GRID + "claims_from: b.yaml\n", "a.yaml")
    grid_file(tmp_path, GRID + "claims_from: c.yaml\n", "b.yaml")
    grid_file(tmp_path, GRID + "claims_from: a.yaml\n", "c.yaml")
    line = one_line(
        capsys, tmp_path, bench_run.main, ["--grid", str(tmp_path / "a.yaml"), "--list"], "claims_from makes a cycle"
    )
    assert "a.yaml -> " in line and "b.yaml -> " in line and "c.yaml -> " in line


def test_a_long_claims_from_chain_is_one_line(tmp_path):
    for index in range(12):
        grid_file(tmp_path, GRID + f"claims_from: g{index + 1}.yaml\n", f"g{index}.yaml")
    grid_file(tmp_path, GRID, "g12.yaml")
    with pytest.raises(BenchError, match="claims_from chains more than"):
        load_grid(tmp_path / "g0.yaml")
    assert load_grid(tmp_path / "g6.yaml").claims == []  # a chain within the bound loads


# -- --out and --keep ---------------------------------------------------------------------------------------


def test_out_pointing_at_a_file_is_one_line(capsys, tmp_path):
    path = grid_file(tmp_path, GRID)
    (tmp_path / "results").write_text("not a folder")
    args = ["--grid", str(path), "--out", str(tmp_path / "results"), "--list"]
    one_line(capsys, tmp_path, bench_run.main, args, "is a file, not a folder")


@pytest.mark.parametrize(
    ("keep", "fragment"),
    [
        ("/", "the filesystem root"),
        ("~", "the home folder"),
        (".", "the current working directory"),
        ("..", "a parent"),
    ],
)
def test_keep_at_root_home_or_the_working_directory_is_one_line(capsys, tmp_path, monkeypatch, keep, fragment):
    monkeypatch.setenv("HOME", str(tmp_path / ("work" if keep == "~" else "home")))
    path = grid_file(tmp_path, GRID)
    args = ["--grid", str(path), "--keep", keep, "--resume", "--plan"]
    one_line(capsys, tmp_path, bench_run.main, args, f"--keep {keep} is {fragment}")


def test_out_at_the_working_directory_is_one_line(capsys, tmp_path):
    path = grid_file(tmp_path, GRID)
    one_line(capsys, tmp_path, bench_run.main, ["--grid", str(path), "--out", ".", "--list"], "the current working")


# -- kept rows and --reuse files read with bounds ---------------------------------------------------------------


def test_a_deeply_nested_kept_row_is_one_line(capsys, tmp_path):
    path = grid_file(tmp_path, GRID)
    keep = tmp_path / "runs"
    (keep / "a-r20").mkdir(parents=True)
    (keep / "a-r20" / ROW_FILE).write_text('{"settings": ' + "[" * 100_000 + "]" * 100_000 + "}")
    args = ["--grid", str(path), "--keep", str(keep), "--resume", "--plan"]
    one_line(capsys, tmp_path, bench_run.main, args, "nested more than")


def test_a_fifo_kept_row_is_one_line_without_blocking(capsys, tmp_path):
    path = grid_file(tmp_path, GRID)
    keep = tmp_path / "runs"
    (keep / "a-r20").mkdir(parents=True)
    os.mkfifo(keep / "a-r20" / ROW_FILE)
    args = ["--grid", str(path), "--keep", str(keep), "--resume", "--plan"]
    one_line(capsys, tmp_path, bench_run.main, args, "a FIFO")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"rows": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested more than"),
        ("[1, 2]", "expected a JSON object"),
        ('{"rows": [{"no id": 1}]}', "is not a glue_grid results file"),
        (None, "is not a file"),
    ],
    ids=["deep", "list", "no-id", "fifo"],
)
def test_a_hostile_reuse_file_is_one_line(capsys, tmp_path, content, fragment):
    reuse = tmp_path / "earlier.json"
    if content is None:
        os.mkfifo(reuse)
    else:
        reuse.write_text(content)
    args = ["--reuse", str(reuse), "--keep", str(tmp_path / "k"), "--task-models", str(tmp_path / "t")]
    one_line(capsys, tmp_path, glue_grid.main, [*args, "--out", str(tmp_path / "results")], fragment)


def test_glue_grid_options_are_checked_like_the_cli(capsys, tmp_path):
    (tmp_path / "results").write_text("a file")
    one_line(capsys, tmp_path, glue_grid.main, ["--out", str(tmp_path / "results")], "is a file, not a folder")
    one_line(capsys, tmp_path, glue_grid.main, ["--keep", "/"], "--keep / is the filesystem root")
    one_line(capsys, tmp_path, glue_grid.main, ["--task-models", "."], "the current working directory")
    one_line(capsys, tmp_path, glue_grid.main, ["--bogus"], "unrecognized arguments: --bogus")
    deep = grid_file(tmp_path, "settings: " + "{a: " * 100 + "1" + "}" * 100 + "\n", "glue.yaml")
    one_line(capsys, tmp_path, glue_grid.main, ["--grid", str(deep)], "nested more than")


def test_a_hostile_kept_task_model_fails_its_row_in_one_line(tmp_path):
    folder = tmp_path / "sst2-s0"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "model" / "recipe.yaml").write_text("task: sst2\nseed: 0\n")
    (folder / "report.json").write_text('{"stages": ' + "[" * 100_000 + "]" * 100_000 + "}")
    opts = glue_rows.RunOptions(None, None, None, None)
    start = time.monotonic()
    row = glue_rows.task_model("sst2", 0, folder, [], opts)
    assert time.monotonic() - start < TIME_LIMIT_S
    assert row["status"] == "failed" and "nested more than" in row["reason"] and "\n" not in row["reason"]


# -- the helpers on their own ---------------------------------------------------------------------------------


def test_the_readers_and_the_folder_check(tmp_path):
    (tmp_path / "ok.yaml").write_text("a: [1, 2]\n")
    assert read_yaml_file(tmp_path / "ok.yaml", "grid file") == {"a": [1, 2]}
    (tmp_path / "big.yaml").write_bytes(b"a: 1\n" + b"#" * (2 << 20))
    with pytest.raises(BenchError, match="more than the 1024 KiB"):
        read_yaml_file(tmp_path / "big.yaml", "grid file")
    (tmp_path / "ok.json").write_text(json.dumps({"rows": []}))
    assert read_json_file(tmp_path / "ok.json", "--reuse") == {"rows": []}
    with pytest.raises(BenchError, match="cannot read"):
        read_json_file(tmp_path / "missing.json", "--reuse")
    check_folder_option("--out", tmp_path / "new" / "results", "the results")
    with pytest.raises(BenchError, match="a path cannot hold a NUL byte"):
        check_folder_option("--out", Path("a\0b"), "the results")


def test_scale_checks_its_folders_and_reads_render_files_with_bounds(capsys, tmp_path):
    from benchmarks import scale

    (tmp_path / "results").write_text("a file")
    one_line(capsys, tmp_path, scale.main, ["--quick", "--out", str(tmp_path / "results")], "is a file, not a folder")
    one_line(capsys, tmp_path, scale.main, ["--quick", "--models-dir", "/"], "--models-dir / is the filesystem root")
    (tmp_path / "old.json").write_text("[" * 100_000 + "]" * 100_000)
    one_line(capsys, tmp_path, scale.main, ["--render", str(tmp_path / "old.json")], "nested more than")


def test_the_file_option_check_and_the_json_writer(tmp_path, capsys):
    from benchmarks.core.outputs import check_file_option, emit_json

    with pytest.raises(BenchError, match=r"--json .*: is a folder"):
        check_file_option("--json", tmp_path)
    with pytest.raises(BenchError, match=r"folder .* does not exist"):
        check_file_option("--json", tmp_path / "no" / "r.json")
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(BenchError, match="symbolic link"):
        check_file_option("--json", link)
    assert not (tmp_path / "elsewhere.json").exists() and not (tmp_path / "no").exists()
    target = tmp_path / "r.json"
    check_file_option("--json", target)
    emit_json({"a": 1}, target, "--json")
    assert json.loads(capsys.readouterr().out) == {"a": 1} == json.loads(target.read_text())


CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA takes --device cuda")
BAD_ARGUMENTS = [
    # run: the grid (its files and folders are above)
    ("run", ["--threads", "0", "--list"], "argument --threads: must be at least 1, got 0"),
    ("run", ["--speed-rounds", "x", "--list"], "argument --speed-rounds: 'x' is not a whole number"),
    ("run", ["--device", "gpu", "--list"], "argument --device: unknown device 'gpu'"),
    ("run", ["--name", "a/b", "--list"], "argument --name: 'a/b' is not a file name"),
    ("run", ["--only", ",", "--list"], "argument --only: ',' names nothing"),
    # scale
    ("scale", ["--quick", "--jobs", "0"], "argument --jobs: must be at least 1, got 0"),
    ("scale", ["--quick", "--memory-fraction", "1.5"], "argument --memory-fraction: must be in (0, 1], got '1.5'"),
    ("scale", ["--quick", "--budget-s", "-5"], "argument --budget-s: must be > 0, got '-5'"),
    ("scale", ["--quick", "--recipes", "lorapp"], "--recipes: unknown recipe 'lorapp'; did you mean 'lorap'?"),
    ("scale", ["--quick", "--configs", "w60-L2"], "--configs: unknown shape(s) w60-L2"),
    ("scale", ["--quick", "--offload-memory", "lots"], "argument --offload-memory: expected a size like 20GiB"),
    ("scale", ["--quick", "--offload-shape", "llama-9b"], "argument --offload-shape: unknown shape 'llama-9b'"),
    ("scale", ["--quick", "--tokenizer", "{tmp}/none"], "argument --tokenizer: {tmp}/none: no such folder"),
    ("scale", ["--quick", "--known-peaks", "{tmp}/none.json"], "argument --known-peaks: cannot read {tmp}/none.json"),
    ("scale", ["--quick", "--known-peaks", "{tmp}/deep.json"], "--known-peaks: "),
    ("scale", ["--quick", "--dtype", "fp8"], "argument --dtype: unknown dtype 'fp8'"),
    pytest.param("scale", ["--quick", "--device", "cuda"], "CUDA is not available", marks=CUDA),
    # moe_scale
    ("moe_scale", ["--quick", "--ratio", "1.5"], "argument --ratio: must be in (0, 1), got '1.5'"),
    ("moe_scale", ["--quick", "--ratio", "0.9"], "leaves 2 of tiny-moe's 16 experts, fewer than the 4"),
    ("moe_scale", ["--quick", "--samples", "0"], "argument --samples: must be at least 1, got 0"),
    ("moe_scale", ["--shapes", "qwen3"], "argument --shapes: invalid choice: 'qwen3'"),
    ("moe_scale", ["--quick", "--dtype", "auto"], "argument --dtype: give float32, bfloat16 or float16"),
    ("moe_scale", ["--quick", "--out", "{tmp}/taken/q"], "--out {tmp}/taken/q.json: {tmp}/taken is not a folder"),
    pytest.param("moe_scale", ["--device", "cuda"], "CUDA is not available", marks=CUDA),
    # moe_plans
    ("moe_plans", ["--models", "qwen3"], "argument --models: invalid choice: 'qwen3'"),
    ("moe_plans", ["--out", "{tmp}/taken"], "--out {tmp}/taken is a file, not a folder"),
    # glue_grid (its files and folders are above)
    ("glue_grid", ["--jobs", "0"], "argument --jobs: must be at least 1, got 0"),
    ("glue_grid", ["--deadline-s", "0"], "argument --deadline-s: must be > 0, got '0'"),
    ("glue_grid", ["--dtype", "fp8"], "argument --dtype: unknown dtype 'fp8'"),
    ("glue_grid", ["--tasks", "cola"], "--tasks: unknown or none ['cola']"),
    ("glue_grid", ["--set", "target.ratio=2"], "target.ratio: Input should be less than 1"),
    ("glue_grid", ["--name", ".."], "argument --name: '..' is not a file name"),
    # speed
    ("speed", ["no-such-model"], "argument models: unknown model source 'no-such-model'"),
    ("speed", ["smollm2-135m", "--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
    ("speed", ["smollm2-135m", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    ("speed", ["smollm2-135m", "--type", "q4"], "argument --type: unknown GGUF type 'q4'"),
    ("speed", ["smollm2-135m", "--json", "{tmp}"], "--json {tmp}: is a folder"),
    ("speed", ["smollm2-135m", "--gguf-dir", "{tmp}/taken"], "--gguf-dir {tmp}/taken is a file, not a folder"),
    # compare
    ("compare", ["--recipes", "nope"], "--recipes nope: unknown recipe 'nope'"),
    ("compare", ["--recipes", "magnitude", "--ratio", "1.5"], "argument --ratio: must be in (0, 1), got '1.5'"),
    ("compare", ["--recipes", "magnitude:steps=5"], "steps= sets the lora stage's steps; magnitude has none"),
    ("compare", ["--recipes", "magnitude", "--ppl", "wiki"], "unknown dataset 'wiki'"),
    ("compare", ["--recipes", "magnitude", "--out", "{tmp}/taken"], "--out {tmp}/taken is a file, not a folder"),
    ("compare", ["--ratio", "0.2"], "the following arguments are required: --recipes"),
    # tradeoff
    ("tradeoff", ["{tmp}/none.json", "{tmp}/deep.json", "--out", "{tmp}/t"], "argument grid: cannot read"),
    ("tradeoff", ["{tmp}/deep.json", "{tmp}/deep.json", "--out", "{tmp}/t"], "GRID: "),
    ("tradeoff", ["{tmp}/list.json", "{tmp}/list.json", "--out", "{tmp}/t"], "GRID: "),
    ("tradeoff", ["{tmp}/deep.json", "{tmp}/deep.json"], "the following arguments are required: --out"),
    ("tradeoff", ["{tmp}/deep.json", "{tmp}/deep.json", "--out", "{tmp}/taken/t"], "{tmp}/taken is not a folder"),
    # exportable, state_hashes
    ("exportable", ["--only", "lorapp"], "argument --only: unknown recipe 'lorapp'"),
    ("exportable", ["--json", "{tmp}"], "--json {tmp}: is a folder"),
    ("state_hashes", ["--only", "nope"], "argument --only: unknown recipe 'nope'"),
    ("state_hashes", ["--write", "{tmp}/no/h.json"], "--write {tmp}/no/h.json: folder {tmp}/no does not exist"),
    # stage_memory
    ("stage_memory", ["nope"], "argument recipes: unknown recipe 'nope'"),
    ("stage_memory", ["deploy", "--heads", "0"], "argument --heads: must be at least 1, got 0"),
    ("stage_memory", ["deploy", "--hidden", "100"], "--hidden must be a multiple of --heads"),
    ("stage_memory", ["deploy", "--json", "{tmp}"], "--json {tmp}: is a folder"),
    # recovery_curve, recovery_step
    ("recovery_curve", ["--out", "{tmp}/r", "--ratio", "1.5"], "argument --ratio: must be in (0, 1), got '1.5'"),
    ("recovery_curve", ["--out", "{tmp}/r", "--tokens", "1e5"], "argument --tokens: '1e5' is not a whole number"),
    ("recovery_curve", ["--out", "{tmp}/r", "--dataset", "wikitext3"], "argument --dataset: unknown dataset"),
    ("recovery_curve", ["--out", "{tmp}/taken"], "--out {tmp}/taken is a file, not a folder"),
    ("recovery_curve", ["--tokens", "100"], "the following arguments are required: --out"),
    ("recovery_step", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("recovery_step", ["--student-mlp", "0"], "argument --student-mlp: must be in (0, 1], got '0'"),
    ("recovery_step", ["--plan-processes", "8,x"], "argument --plan-processes: 'x' is not a whole number"),
    ("recovery_step", ["--sharding", "fsdp"], "--sharding fsdp trains every weight: give --adapter none"),
    ("recovery_step", ["--out", "{tmp}"], "--out {tmp}: is a folder"),
    # prunenet_diagnose, prunenet_sp3_cost
    ("prunenet_diagnose", ["--ratio", "1.5"], "argument --ratio: must be in (0, 1), got '1.5'"),
    ("prunenet_diagnose", ["--variants", "future:step"], "argument --variants: 'future:step': use RETURNS:UPDATE"),
    ("prunenet_diagnose", ["--model", "nope"], "argument --model: unknown model source 'nope'"),
    ("prunenet_diagnose", ["--seeds", "-1"], "argument --seeds: must be at least 0, got -1"),
    ("prunenet_diagnose", ["--json", "{tmp}"], "--json {tmp}: is a folder"),
    ("prunenet_sp3_cost", ["--quick", "--ratio", "1"], "argument --ratio: must be in (0, 1), got '1'"),
    ("prunenet_sp3_cost", ["--dtype", "auto"], "argument --dtype: give float32, bfloat16 or float16"),
    ("prunenet_sp3_cost", ["--heads", "6", "--kv-heads", "4"], "--heads 6 must be a multiple of --kv-heads 4"),
    ("prunenet_sp3_cost", ["--hidden", "0"], "argument --hidden: must be at least 1, got 0"),
    ("prunenet_sp3_cost", ["--device", "gpu"], "argument --device: unknown device 'gpu'"),
    ("prunenet_sp3_cost", ["--quick", "--json", "{tmp}"], "--json {tmp}: is a folder"),
    # gguf_fidelity, gguf_perplexity, dense_cache_cost, tables
    ("gguf_fidelity", ["{tmp}/none"], "argument folder: {tmp}/none: no such folder"),
    ("gguf_fidelity", ["{tmp}"], "{tmp} has no config.json"),
    ("gguf_fidelity", ["{tmp}", "--gguf-file", "m.gguf"], "--gguf-file m.gguf: no such file in {tmp}"),
    ("gguf_fidelity", ["{tmp}", "--out", "{tmp}/taken"], "--out {tmp}/taken is a file, not a folder"),
    ("gguf_fidelity", ["{tmp}", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ("gguf_perplexity", ["no-such-model"], "argument source: unknown model source 'no-such-model'"),
    ("gguf_perplexity", ["smollm2-135m", "--dataset", "wikitext3"], "argument --dataset: unknown dataset"),
    ("gguf_perplexity", ["smollm2-135m", "--max-tokens", "8", "--seq-len", "16"], "below one window of --seq-len 16"),
    ("gguf_perplexity", ["smollm2-135m", "--type", "q4_k"], "argument --type: unknown GGUF type 'q4_k'"),
    ("gguf_perplexity", ["smollm2-135m", "--json", "{tmp}"], "--json {tmp}: is a folder"),
    ("gguf_perplexity", ["smollm2-135m", "--out", "{tmp}/taken"], "--out {tmp}/taken is a file, not a folder"),
    ("dense_cache_cost", ["--source", "nope"], "argument --source: unknown model source 'nope'"),
    ("dense_cache_cost", ["--source", "{tmp}"], "argument --source: model folder {tmp} has no config.json"),
    ("dense_cache_cost", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ("tables", ["{tmp}/none.json"], "argument result: cannot read {tmp}/none.json"),
    ("tables", ["{tmp}/deep.json"], "RESULT: "),
    ("tables", [], "the following arguments are required: result"),
]


def results_listing() -> dict[str, float]:
    from benchmarks.core.outputs import RESULTS

    return {path.name: path.stat().st_mtime for path in RESULTS.iterdir()}


@pytest.mark.parametrize(("module", "argv", "fragment"), BAD_ARGUMENTS)
def test_every_tool_refuses_a_bad_argument_in_one_line_before_any_work(capsys, tmp_path, module, argv, fragment):
    """A bad number, name, input or output of any tool: one ``error:`` line, exit 2, within the time bound, and
    nothing written (neither under the test's folder nor in benchmarks/results)."""
    import importlib

    (tmp_path / "taken").write_text("not slimkit's")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "list.json").write_text("[1, 2]")
    results = results_listing()
    main = importlib.import_module(f"benchmarks.{module}").main
    tmp = str(tmp_path)
    line = one_line(capsys, tmp_path, main, [a.replace("{tmp}", tmp) for a in argv], fragment.replace("{tmp}", tmp))
    assert results_listing() == results, line
