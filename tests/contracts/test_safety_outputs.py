"""Output-folder safety: what ``--force`` may replace, atomic replacement, one run per ``--out``, clean-up after
killed runs, and signals (Ctrl-C, SIGTERM, SIGKILL) at compute and replace time.

The subprocess tests pause a run at one of its milestones (:meth:`slimkit.engine.progress.Tracker.reached`, replaced
in the child process by :data:`PAUSING`: the run says ``slimkit: paused at POINT`` on stderr and sleeps there) to
signal it at a known moment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

import slimkit
from slimkit.engine import runner
from slimkit.engine.output_safety import RUN_MARKER, check_output_dir
from slimkit.engine.progress import Tracker
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.files import atomic as paths
from slimkit.primitives.files.lock import acquire_lock
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import byte_tokenizer, tiny_llama

PAUSING = (
    "import os, sys, time\n"
    "from slimkit.engine.progress import Tracker\n"
    "def reached(self, point):\n"
    "    if point == os.environ['PAUSE_AT']:\n"
    "        print(f'slimkit: paused at {point}', file=sys.stderr, flush=True)\n"
    "        time.sleep(float(os.environ['PAUSE_S']))\n"
    "Tracker.reached = reached\n"
)
"""Child-process code: every tracker of the run (the API's default, the CLI's) pauses at ``PAUSE_AT`` for ``PAUSE_S``
seconds."""
RUN = PAUSING + (
    "import json, slimkit\nslimkit.run(json.loads(sys.argv[1]), out=sys.argv[2], force=True, evaluate=False)\n"
)
CLI = PAUSING + "import runpy\nsys.argv[0] = 'slimkit'\nrunpy.run_module('slimkit.cli.main', run_name='__main__')\n"


def recipe(model_dir: Path, name: str) -> dict:
    return tiny_recipe(model_dir, name=name, eval={"perplexity": None})


@pytest.fixture(autouse=True)
def default_sigint():
    """Ctrl-C raises KeyboardInterrupt here and in the runs these tests start, however the suite was started: a
    job started in the background (``make test-fast &``, nohup, some CI runners) inherits SIGINT ignored, and a
    child process started from it would ignore SIGINT too (exec keeps an ignored signal ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tokenizer = byte_tokenizer()
    path = tmp_path_factory.mktemp("source") / "tiny-llama"
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def old_template(model_dir, tmp_path_factory) -> Path:
    """A finished run's output folder (recipe name ``old-run``), copied by :func:`old_result`."""
    out = tmp_path_factory.mktemp("template") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "slimkit-cache"))
        slimkit.run(recipe(model_dir, "old-run"), out=out, evaluate=False)
    return out


@pytest.fixture
def old_result(old_template, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(old_template, out)
    return out


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the run gets as far as loading the model."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the output folder was refused")

    monkeypatch.setattr(runner, "load_source", refuse)


def assert_complete(out: Path, recipe_name: str) -> None:
    """``out`` holds a whole run of ``recipe_name``: its report and model weights load."""
    assert json.loads((out / "report.json").read_text())["recipe"] == recipe_name
    assert (out / "model" / "model.safetensors").is_file()
    slimkit.load(out / "model")


def siblings(out: Path) -> list[str]:
    """Hidden names slimkit keeps beside ``out`` (partial, replaced, lock)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# -- what --force may replace ---------------------------------------------------------------------


def test_force_never_replaces_the_working_directory_its_parents_home_or_root(
    monkeypatch, capsys, tmp_path, model_dir, no_loading
):
    work = tmp_path / "home" / "work"
    (work / "a").mkdir(parents=True)
    (work / "notes.txt").write_text("keep me")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    file = str(tmp_path / "r.yaml")
    Path(file).write_text(yaml.safe_dump(recipe(model_dir, "new-run")))
    code, _, err = run_cli(monkeypatch, capsys, "recipe", "run", file, "--out", ".", "--force")
    assert_one_line_error(code, err, "--out . is the current working directory")
    assert (work / "notes.txt").read_text() == "keep me" and (work / "a").is_dir()
    for out, reason in [
        ("a/..", "the current working directory"),
        ("..", "the home folder"),
        (str(tmp_path), "a parent of the current working directory"),
        ("/", "the filesystem root"),
    ]:
        with pytest.raises(SlimkitError, match=f"--out .* is {reason}"):
            check_output_dir(Path(out), force=True)
    monkeypatch.chdir(work / "a")
    with pytest.raises(SlimkitError, match="is a parent of the current working directory"):
        slimkit.run(recipe(model_dir, "new-run"), out="..", force=True)
    assert (work / "notes.txt").read_text() == "keep me"


def test_force_refuses_a_folder_that_is_not_a_slimkit_output(tmp_path, model_dir, no_loading):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("\\documentclass{article}")
    with pytest.raises(SlimkitError, match=r"--out .*thesis is not a slimkit output \(it holds thesis.tex"):
        slimkit.run(recipe(model_dir, "new-run"), out=out, force=True)
    assert (out / "thesis.tex").read_text() == "\\documentclass{article}"


def test_force_replaces_slimkit_outputs_and_empty_folders(tmp_path):
    """A run's output is what its marker lists, at every depth (a report.json alone does not make a folder a run's;
    a marker listing top-level names only does not cover what is inside ``model/``)."""
    marker = {
        "written_by": "slimkit recipe run",
        "files": ["model/slimkit_manifest.json", "report.json", "report.md"],
        "folders": ["model"],
    }
    for name, files in [
        ("run", ["report.json", RUN_MARKER]),
        ("run-model-only", ["model/slimkit_manifest.json", RUN_MARKER]),
        ("empty", []),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        for file in files:
            (folder / file).parent.mkdir(exist_ok=True)
            (folder / file).write_text(json.dumps(marker) if file == RUN_MARKER else "{}")
        check_output_dir(folder, force=True)
    for name, files, message in [
        ("report-only", ["report.json"], "is not a slimkit output"),
        ("saved-model", ["slimkit_manifest.json", "config.json"], "is not a slimkit output"),
        ("run-and-notes", ["report.json", RUN_MARKER, "notes.txt"], "holds notes.txt, which slimkit did not write"),
        (
            "run-and-nested-notes",
            ["model/slimkit_manifest.json", "model/notes.txt", RUN_MARKER],
            "holds model/notes.txt, which slimkit did not write",
        ),
    ]:
        folder = tmp_path / name
        folder.mkdir()
        for file in files:
            (folder / file).parent.mkdir(exist_ok=True)
            (folder / file).write_text(json.dumps(marker) if file == RUN_MARKER else "{}")
        with pytest.raises(SlimkitError, match=message):
            check_output_dir(folder, force=True)


def test_an_unwritable_out_is_refused_before_loading(monkeypatch, tmp_path, model_dir, no_loading):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SlimkitError, match=r"--out .*file/sub/out: .*file is a file, not a folder"):
        slimkit.run(recipe(model_dir, "new-run"), out=tmp_path / "file" / "sub" / "out")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    with pytest.raises(SlimkitError, match=r"--out .*locked/out: no permission to write in .*locked"):
        slimkit.run(recipe(model_dir, "new-run"), out=locked / "out")


def test_calibration_longer_than_the_model_positions_is_refused(monkeypatch, tmp_path, model_dir):
    def never(*_args, **_kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(runner, "calibration_batches", never)
    data = recipe(model_dir, "new-run")
    data["calibration"]["seq_len"] = 512  # the tiny llama has 256 positions
    with pytest.raises(SlimkitError, match=r"calibration.seq_len: 512 is longer .* max_position_embeddings \(256\)"):
        slimkit.run(data, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- atomic replacement -----------------------------------------------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_force_replaces_an_old_result_and_leaves_nothing_beside_it(monkeypatch, old_result, model_dir, exchange):
    if not exchange:
        monkeypatch.setattr(paths, "_exchange", lambda _a, _b: False)
    slimkit.run(recipe(model_dir, "new-run"), out=old_result, force=True, evaluate=False)
    assert_complete(old_result, "new-run")
    assert siblings(old_result) == []


def test_a_signal_between_the_two_renames_waits_until_the_new_result_is_in(monkeypatch, old_result, model_dir):
    """Without renameat2 the old folder is renamed aside, then the new one in: Ctrl-C between them must wait.

    The signal lands on another thread (as a Ctrl-C may: any thread of the process can take it); Python still
    handles it in the main thread."""
    monkeypatch.setattr(paths, "_exchange", lambda _a, _b: False)
    real_replace = os.replace
    go = threading.Event()

    def interrupt_from_this_thread():
        go.wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    sender = threading.Thread(target=interrupt_from_this_thread, daemon=True)
    sender.start()

    def replace_then_interrupt(src, dst):
        real_replace(src, dst)
        if Path(src) == old_result:  # the old folder is aside, the new one not yet in
            go.set()
            sender.join()

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        slimkit.run(recipe(model_dir, "new-run"), out=old_result, force=True, evaluate=False)
    assert_complete(old_result, "new-run")
    assert siblings(old_result) == []


def test_an_out_filled_during_the_run_is_not_overwritten(monkeypatch, tmp_path, model_dir):
    out = tmp_path / "out"

    class SomeoneWrites(Tracker):
        def reached(self, point: str) -> None:
            if point == "replace":
                out.mkdir()
                (out / "theirs.txt").write_text("written meanwhile")

    with pytest.raises(
        SlimkitError, match=r"not empty \(use --force .*\); it changed while this run computed, so nothing was written"
    ):
        slimkit.run(recipe(model_dir, "new-run"), out=out, evaluate=False, tracker=SomeoneWrites())
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert siblings(out) == []


# -- one run per --out, and what killed runs leave --------------------------------------------------


def test_a_second_run_to_a_locked_out_fails_before_loading(monkeypatch, tmp_path, model_dir):
    out = tmp_path / "out"
    lock = acquire_lock(out)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(runner, "load_source", lambda *a, **k: pytest.fail("loaded"))
            with pytest.raises(SlimkitError) as error:
                slimkit.run(recipe(model_dir, "new-run"), out=out)
        assert str(error.value) == f"--out {out} is being written by another slimkit run (pid {os.getpid()})"
    finally:
        lock.release()
    (tmp_path / ".out.lock").write_text(f"{dead_pid()}\n")  # a lock file a killed run left: not held
    slimkit.run(recipe(model_dir, "new-run"), out=out, evaluate=False)
    assert_complete(out, "new-run")
    assert siblings(out) == []


def test_leftovers_of_dead_runs_are_removed_and_live_ones_kept(tmp_path, model_dir):
    out = tmp_path / "out"
    dead = tmp_path / f".out.partial-{dead_pid()}-abcd1234"
    (dead / "model").mkdir(parents=True)
    (dead / "model" / "config.json").write_text("{}")
    dead_file = tmp_path / f".out.partial-{dead_pid()}-efgh5678"
    dead_file.write_text("half a file")
    live = tmp_path / f".out.partial-{os.getpid()}-ijkl9012"
    live.mkdir()
    other = tmp_path / f".other.partial-{dead_pid()}-mnop3456"
    other.mkdir()
    result = slimkit.run(recipe(model_dir, "new-run"), out=out, evaluate=False)
    assert_complete(out, "new-run")
    assert not dead.exists() and not dead_file.exists()
    assert live.is_dir() and other.is_dir()
    notes = [note for note in result.report.as_json()["notes"] if note.startswith("removed")]
    assert len(notes) == 2 and dead.name in " ".join(notes) and "did not finish" in notes[0]


def test_a_result_a_killed_run_left_aside_is_restored(tmp_path, old_result, model_dir):
    aside = tmp_path / f".out.replaced-{dead_pid()}-abcd1234"
    os.replace(old_result, aside)  # killed between renaming the old result aside and the new one in
    with pytest.raises(SlimkitError, match=r"exists and is not empty .*\(restored .* from \.out\.replaced-"):
        slimkit.run(recipe(model_dir, "new-run"), out=old_result, evaluate=False)
    assert_complete(old_result, "old-run")
    assert siblings(old_result) == []


# -- signals and concurrent runs, in real processes ------------------------------------------------


def start(args: list[str], pause_at: str, pause_s: float = 60) -> subprocess.Popen:
    env = {**os.environ, "PAUSE_AT": pause_at, "PAUSE_S": str(pause_s), "COLUMNS": "200"}
    process = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    watchdog = threading.Timer(300, process.kill)
    watchdog.daemon = True
    watchdog.start()
    return process


def wait_for_pause(process: subprocess.Popen, point: str) -> None:
    seen = []
    for line in process.stderr:
        seen.append(line)
        if line.strip() == f"slimkit: paused at {point}":
            return
    process.wait()
    pytest.fail(f"the run ended (status {process.returncode}) before pausing at {point}:\n{''.join(seen)}")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["compute", "save", "replace"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["INT", "TERM", "KILL"])
def test_a_signal_during_a_run_keeps_the_old_result(old_result, model_dir, sig, point):
    process = start(["-c", RUN, json.dumps(recipe(model_dir, "new-run")), str(old_result)], point)
    wait_for_pause(process, point)
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert_complete(old_result, "old-run")
    if sig == signal.SIGKILL:  # nothing could clean up; the next run does
        result = slimkit.run(recipe(model_dir, "new-run"), out=old_result, force=True, evaluate=False)
        assert_complete(old_result, "new-run")
        left = [note for note in result.report.as_json()["notes"] if note.startswith("removed")]
        assert len(left) == (point != "compute") and (not left or f"pid {process.pid}" in left[0])  # a partial folder
    else:  # Ctrl-C and SIGTERM: the run deleted its partial folder and let go of its lock
        assert ("Terminated: terminated (SIGTERM)" if sig == signal.SIGTERM else "KeyboardInterrupt") in err, err
    assert siblings(old_result) == []


@pytest.mark.slow
def test_two_runs_to_the_same_out_one_succeeds(tmp_path, model_dir):
    out = tmp_path / "out"
    file = tmp_path / "r.yaml"
    file.write_text(yaml.safe_dump(recipe(model_dir, "new-run")))
    args = ["-c", CLI, "recipe", "run", str(file), "--out", str(out)]
    both = [start(args, "compute", pause_s=5) for _ in range(2)]
    results = [process.communicate(timeout=240) for process in both]
    codes = sorted(process.returncode for process in both)
    assert codes == [0, 2], results
    winner, loser = (0, 1) if both[0].returncode == 0 else (1, 0)
    err = results[loser][1]
    assert_one_line_error(2, err, f"--out {out} is being written by another slimkit run (pid {both[winner].pid})")
    assert_complete(out, "new-run")
    assert siblings(out) == []


def test_save_and_export_clean_what_a_killed_write_left_beside_them(tmp_path):
    from slimkit.primitives.export import export
    from tests.tiny import bpe_tokenizer, tiny_llama

    tokenizer = bpe_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    stale = tmp_path / f".m.partial-{dead_pid()}-abcd1234"
    stale.mkdir()
    slimkit.save(model, tokenizer, tmp_path / "m")
    stale_file = tmp_path / f".x.gguf.partial-{dead_pid()}-efgh5678"
    stale_file.write_text("half a file")
    export(model, tmp_path / "x.gguf", "gguf", "f32", tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "x.gguf"]
