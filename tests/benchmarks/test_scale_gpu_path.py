"""The GPU cost run's pieces (benchmarks.scale), checked on the CPU: recipes, shapes, budget rows, OOM rows."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.scale import (
    RECOVERY_STAGES,
    llm_recipes,
    markdown,
    out_of_memory,
    recipe_weight,
    sample_memory,
    scale_recipe,
    skipped_row,
    synthetic_shape,
)


def test_all_recipes_are_the_causal_lm_ones_without_recovery():
    names = llm_recipes()
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
    assert sampled["timed_out"] and process.returncode is not None
    assert time.perf_counter() - start < 20
