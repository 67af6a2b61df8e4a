"""The GPU cost run's pieces (benchmarks.scale), checked on the CPU: recipes, shapes, budget rows, OOM rows."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.core.errors import BenchError
from benchmarks.core.recipes import RECOVERY_STAGES, causal_lm_recipes
from benchmarks.scale_process import out_of_memory, sample_memory, skipped_row
from benchmarks.scale_recipes import recipe_weight, scale_recipe
from benchmarks.scale_report import markdown
from benchmarks.scale_shapes import synthetic_shape


def test_all_recipes_are_the_causal_lm_ones_without_recovery():
    names = causal_lm_recipes()
    assert "llm-pruner" in names and "cce" in names and "lorap+reconstruct+distill" in names
    assert not {"cofi-bert", "sp3-bert", "glue-finetune"} & set(names)
    raw, dropped = scale_recipe("lorap+reconstruct+distill", 8, 64)
    assert dropped == ["distill"]  # inside the sequential block
    stages = [c["stage"] for s in raw["stages"] for c in s.get("sequential", [s])]
    assert not RECOVERY_STAGES & set(stages) and "reconstruct" in stages
    # cheapest first: the one-shot recipes before the iterative and trained ones
    assert recipe_weight("sp3-oneshot") < recipe_weight("llm-pruner") < recipe_weight("lorap+reconstruct")
    assert recipe_weight("lorap+reconstruct") < min(recipe_weight("cce"), recipe_weight("sp3-llm"))


def test_tiny_synthetic_shapes():
    shape = synthetic_shape("w64-L4")
    assert (shape.hidden, shape.layers, shape.kind) == (64, 4, "real")
    assert synthetic_shape("w60-L4") is None and synthetic_shape("llama") is None


def test_oom_and_skipped_rows_render():
    assert out_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert out_of_memory("MemoryError") and not out_of_memory("error: target missed")
    row = skipped_row(synthetic_shape("w64-L4"), ["real"], "cce", None, "bfloat16") | {"reason": "not run: 3 s left"}
    result = {"date": "d", "command": "c", "machine": {"cpu": "x", "cores": 2, "memory_gb": 1.0, "torch_threads": 2}}
    result["machine"]["python"] = "3.12"
    result |= {"versions": {}, "rows": [row], "baseline": {"status": "not run"}}
    result |= {"settings": {"device": "cuda", "dtype": "bfloat16", "samples": 8, "seq_len": 128, "recipes": ["cce"]}}
    assert "| w64-L4 | `cce` | 4 | 64 | - | " in markdown(result) and "**skipped**: not run: 3 s left" in markdown(
        result
    )


def test_a_run_past_its_deadline_is_killed_with_its_children():
    code = "import subprocess, sys; subprocess.call([sys.executable, '-c', 'import time; time.sleep(60)'])"
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    start = time.perf_counter()
    sampled = sample_memory(process, every_s=0.05, deadline=start + 1.0)
    assert sampled["timed_out"] and process.returncode is not None and sampled["cpu_s"] >= 0  # its own, by wait4
    assert time.perf_counter() - start < 20


def _ok_row(shape, sweeps, recipe, memory, dtype):
    row = skipped_row(shape, sweeps, recipe, memory, dtype) | {"status": "ok", "layer_params": 1, "notes": []}
    stages = {"load": 1.0, "calibration": 1.0, "0:prune": 2.0, "save": 1.0}
    row |= {"stages_s": stages, "load_s": 1.0, "calibration_s": 1.0, "save_s": 1.0, "compress_s": 3.0}
    row |= {"s_per_layer": 1.5, "total_s": 5.0, "peak_rss_mb": 900.0, "peak_gpu_mb": None, "params_before": 10**6}
    return row | {"params_after": 8 * 10**5, "achieved": 0.2, "target_met": True}


def test_jobs_run_rows_side_by_side_and_one_short_of_memory_again_alone(tmp_path, monkeypatch):
    # a fake runner: the first two rows meet at a barrier (so they certainly ran beside each other); the wanda row
    # runs out of memory whenever another row runs, so it is run again, alone, at the end, and says so
    import benchmarks.scale as scale
    import benchmarks.scale_queue as scale_queue

    barrier, lock, active, calls = threading.Barrier(2, timeout=20), threading.Lock(), set(), []

    def fake_run_one(shape, sweeps, folder, recipe, args, dtype, scratch, max_memory=None, timeout_s=None, live=None):
        with lock:
            active.add(recipe)
            first = len(calls) < 2
            calls.append(recipe)
        if first:
            barrier.wait()
        with lock:
            crowded = len(active) > 1
        time.sleep(0.1)
        with lock:
            active.discard(recipe)
        if recipe == "wanda-channels" and crowded:
            row = skipped_row(shape, sweeps, recipe, max_memory, dtype)
            return row | {"status": "oom", "reason": "exit 1: torch.OutOfMemoryError: CUDA out of memory"}
        return _ok_row(shape, sweeps, recipe, max_memory, dtype)

    monkeypatch.setattr(scale_queue, "run_one", fake_run_one)
    monkeypatch.setattr(scale, "model_folder", lambda *a, **k: (tmp_path, None))
    argv = ["--configs", "w64-L2", "--recipes", "wanda-channels,magnitude", "--no-sweeps", "--offload-memory", "none"]
    argv += ["--no-baseline", "--jobs", "2", "--out", str(tmp_path / "out"), "--name", "jobs"]
    earlier = {
        "settings": {"dtype": "float32"},
        "rows": [{"id": "w64-L2/magnitude", "status": "ok", "peak_gpu_mb": 500}],
    }
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    (tmp_path / "other.json").write_text(json.dumps({"settings": {"dtype": "bfloat16"}, "rows": []}))
    argv += ["--known-peaks", str(tmp_path / "earlier.json"), str(tmp_path / "other.json")]
    result = scale.run(scale.build_parser().parse_args(argv), argv)
    assert sorted(calls[:2]) == ["magnitude", "wanda-channels"] and calls[2:] == ["wanda-channels"]
    rows = {r["recipe"]: r for r in result["rows"]}
    assert rows["magnitude"]["status"] == "ok" and rows["magnitude"]["beside"] == ["w64-L2/wanda-channels"]
    again = rows["wanda-channels"]
    assert again["status"] == "ok" and again["beside"] == [] and again["rerun_of"]["status"] == "oom"
    assert again["rerun_of"]["beside"] == ["w64-L2/magnitude"] and len(result["rows"]) == 2
    assert again["planned_peak_mb"] > 0 and again["expected_peak_mb"] > again["planned_peak_mb"]
    # the measured 500 MB is above magnitude's tiny plan: it is what the row expects (x 1.2 + 1 GiB)
    assert rows["magnitude"]["expected_peak_mb"] == pytest.approx(500 * 1.2 + 1024)
    assert result["settings"]["concurrency"]["jobs"] == 2
    text = markdown(result)
    assert "| w64-L2 | `magnitude` | beside 1 | 2 |" in text and "alone (again, after oom beside 1)" in text
    assert "not comparable with a row run alone" in text


def test_jobs_options_are_checked_before_any_work(tmp_path):
    from benchmarks.scale import build_parser, plan

    common = ["--no-sweeps", "--offload-memory", "none", "--configs", "w64-L2", "--out", str(tmp_path)]
    with pytest.raises(BenchError, match="argument --jobs: must be at least 1, got 0"):
        build_parser().parse_args([*common, "--jobs", "0"])
    with pytest.raises(BenchError, match=r"argument --memory-fraction: must be in \(0, 1\], got '1\.5'"):
        build_parser().parse_args([*common, "--memory-fraction", "1.5"])
    variant = "sp3-llm@stages.1.args.learning_rate=0"
    _shapes, recipes, _offload = plan(build_parser().parse_args([*common, "--recipes", f"all,cce,{variant}"]))
    assert recipes == [*causal_lm_recipes(), variant]  # 'all' and more: each recipe once, the variant after them
    with pytest.raises(BenchError, match="--known-peaks"):
        build_parser().parse_args([*common, "--known-peaks", str(tmp_path / "missing.json")])
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BenchError, match=r"--known-peaks: .* nested more than"):
        plan(build_parser().parse_args([*common, "--known-peaks", str(tmp_path / "deep.json")]))


def test_resume_from_an_earlier_days_file_keeps_its_ok_rows(tmp_path, monkeypatch):
    """A second GPU session on another day: --resume-from names the earlier results file; its ok rows are kept
    (not run again), the others run, and the results go under today's name."""
    import benchmarks.scale as scale
    import benchmarks.scale_queue as scale_queue

    calls = []

    def fake_run_one(shape, sweeps, folder, recipe, args, dtype, scratch, max_memory=None, timeout_s=None, live=None):
        calls.append(recipe)
        return _ok_row(shape, sweeps, recipe, max_memory, dtype)

    monkeypatch.setattr(scale_queue, "run_one", fake_run_one)
    monkeypatch.setattr(scale, "model_folder", lambda *a, **k: (tmp_path, None))
    shape = scale.synthetic_shape("w64-L2")
    failed = _ok_row(shape, ["real"], "wanda-channels", None, "float32") | {"status": "oom", "reason": "exit 1"}
    earlier = {"rows": [_ok_row(shape, ["real"], "magnitude", None, "float32"), failed], "wall_s": 100.0}
    (tmp_path / "2026-11-01-gpu.json").write_text(json.dumps(earlier))
    argv = ["--configs", "w64-L2", "--recipes", "wanda-channels,magnitude", "--no-sweeps", "--offload-memory", "none"]
    argv += ["--no-baseline", "--out", str(tmp_path / "out"), "--name", "gpu"]
    argv += ["--resume-from", str(tmp_path / "2026-11-01-gpu.json")]
    result = scale.run(scale.build_parser().parse_args(argv), argv)
    assert calls == ["wanda-channels"]  # magnitude's ok row kept, the oom row run again
    assert {r["recipe"] for r in result["rows"]} == {"magnitude", "wanda-channels"}
    assert result["resumed_from"].endswith("2026-11-01-gpu.json") and result["resumed_wall_s"] == 100.0

    with pytest.raises(BenchError, match="--resume-from"):
        scale.plan(scale.build_parser().parse_args([*argv[:-1], str(tmp_path / "missing.json")]))
