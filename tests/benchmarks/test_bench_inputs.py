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

from benchmarks import glue_grid
from benchmarks import run as bench_run
from benchmarks.grid import BenchError, load_grid
from benchmarks.inputs import check_folder_option, read_json_file, read_yaml_file
from tests.contracts.hostile import tree_checksum

TIME_LIMIT_S = 20.0
GRID = "grid: [{recipe: a, ratios: [0.2]}]\nquick: {grid: [{recipe: a}]}\n"


@pytest.fixture(autouse=True)
def bench_env(monkeypatch, tmp_path):
    """The environment the entry points set (so it does not leak into other tests), run from ``tmp_path/work``."""
    for key, value in {**bench_run.OFFLINE_ENV, **bench_run.QUIET_ENV}.items():
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
    (keep / "a-r20" / bench_run.ROW_FILE).write_text('{"settings": ' + "[" * 100_000 + "]" * 100_000 + "}")
    args = ["--grid", str(path), "--keep", str(keep), "--resume", "--plan"]
    one_line(capsys, tmp_path, bench_run.main, args, "nested more than")


def test_a_fifo_kept_row_is_one_line_without_blocking(capsys, tmp_path):
    path = grid_file(tmp_path, GRID)
    keep = tmp_path / "runs"
    (keep / "a-r20").mkdir(parents=True)
    os.mkfifo(keep / "a-r20" / bench_run.ROW_FILE)
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
    opts = glue_grid.RunOptions(None, None, None, None)
    start = time.monotonic()
    row = glue_grid.task_model("sst2", 0, folder, [], opts)
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
    from benchmarks.inputs import check_file_option, emit_json

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


@pytest.mark.parametrize(
    ("module", "argv", "option"),
    [
        ("gguf_perplexity", ["no-such-model", "--json", "{tmp}"], "--json"),
        ("prunenet_sp3_cost", ["--quick", "--json", "{tmp}"], "--json"),
        ("recovery_step", ["--out", "{tmp}"], "--out"),
        ("speed", ["no-such-model", "--json", "{tmp}"], "--json"),
        ("speed", ["no-such-model", "--gguf-dir", "{tmp}/taken"], "--gguf-dir"),
        ("gguf_fidelity", ["no-such-folder", "--out", "{tmp}/taken"], "--out"),
        ("gguf_fidelity", ["no-such-folder", "--no-such-option"], "unrecognized arguments"),
    ],
)
def test_the_measuring_tools_check_their_outputs_before_any_work(capsys, tmp_path, module, argv, option):
    """A folder where a JSON file goes, or a file where a folder goes: one line, exit 2, nothing loaded or written."""
    import importlib

    (tmp_path / "taken").write_text("not slimkit's")
    before = tree_checksum(tmp_path)
    main = importlib.import_module(f"benchmarks.{module}").main
    assert main([arg.replace("{tmp}", str(tmp_path)) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and option in err and err.count("\n") == 1
    assert tree_checksum(tmp_path) == before
