"""The recovery-curve and recovery-step benchmarks: a distillation row's recipe validates, the table states the goal
met or missed by the measured amount, and the step benchmark runs on the tiny shape."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import recovery_curve, recovery_step
from slimkit.recipes.loading import validate


def _report(ppl, dense, **distill):
    return {
        "metrics": {"wikitext2_ppl": ppl},
        "dense": {"metrics": {"wikitext2_ppl": dense}},
        "stages": {"distill": distill},
    }


def test_a_distillation_row_validates_and_the_table_states_the_goal(tmp_path, tiny_llama_dir):
    args = recovery_curve.build_parser().parse_args(["--out", str(tmp_path), "--tokens", "1000"])
    quality = {"eval": {"perplexity": {"datasets": ["wikitext2"], "seq_len": 32, "max_tokens": 64}}}
    recipe = recovery_curve.distill_recipe(args, tiny_llama_dir, 1000, quality)
    parsed = validate(recipe, "row")
    assert parsed.stages[0].parsed_args().tokens == 1000
    rows = [recovery_curve.row(0, _report(45.0, 30.0)), recovery_curve.row(1000, _report(42.0, 30.0, tokens=1000))]
    assert rows[1]["wikitext2_x_dense"] == 1.4 and rows[1]["trained_tokens"] == 1000
    recovery_curve.write_results(rows, args)
    assert "missed by 0.10x (best 1.400x)" in (tmp_path / "curve.md").read_text()
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "curve.json").read_text())["rows"]) == 2


def test_the_step_benchmark_runs_on_the_tiny_shape(tmp_path):
    out = tmp_path / "step.json"
    assert recovery_step.main(["--shape", "tiny", "--steps", "2", "--seq-len", "32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["tokens_per_second"] > 0 and result["planned_gib"]["teacher"] > 0


def test_the_step_benchmark_trains_every_weight_and_plans_fsdp_processes(tmp_path):
    out = tmp_path / "step.json"
    argv = ["--shape", "tiny", "--steps", "2", "--seq-len", "32", "--adapter", "none", "--out", str(out)]
    assert recovery_step.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["adapter"] == "none" and result["processes"] == 1
    assert "adapters" not in result["planned_gib"] and result["planned_gib"]["student training"] > 0
    fsdp = argparse.Namespace(batch_size=4, seq_len=32, micro_batch_size=None, adapter="none", sharding="fsdp")
    one, eight = (recovery_step.planned_bytes(recovery_step.SHAPES["8b"], fsdp, torch.bfloat16, n) for n in (1, 8))
    assert eight["student training"] == pytest.approx(one["student training"] / 8, rel=1e-6)
    assert eight["teacher"] == one["teacher"] and eight["gathered units"] > 0
    assert recovery_step.main([*argv, "--sharding", "fsdp", "--adapter", "lora"]) == 2
