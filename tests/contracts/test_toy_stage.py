"""A stage defined outside the package runs end to end with no edit to the engine: the stage interface is complete.

``toy_trim`` (a layer stage) removes the last ``count`` MLP channels of every layer. Everything the engine needs to
know about it is its :class:`~slimkit.engine.stage_args.StageArgs` methods and its registration: its budget and
plan, the projections it touches, that it reads no calibration data, its memory estimate, its check against the rest
of the recipe, and its report entry. The test registers it, validates a recipe using it (and one it refuses), makes
the memory plan, runs it on a tiny Llama, saves and reloads the result, reads the report, and finds it in
``slimkit stage list`` and ``slimkit stage show``.
"""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import Field

import slimkit
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.memory_check import recipe_memory_plan
from slimkit.engine.registry import STAGES, register_stage, stage_names
from slimkit.engine.stage_args import BudgetMode, StageArgs
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch import LayerView
from slimkit.primitives.device.memory_model import GIB, StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.loading import validate
from tests.cli.test_cli import run_cli

SCRATCH = GIB
"""The toy stage's declared scratch memory (one GiB: visible in the plan's two-decimal GiB)."""


class ToyTrimArgs(StageArgs):
    count: int = Field(16, ge=1)
    """MLP channels removed from the end of every layer."""

    def budget(self) -> BudgetMode:
        return "explicit"

    def touches(self) -> frozenset[str]:
        return frozenset({"gate", "up", "down"})

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        return StageMemory(stage, {"toy scratch": SCRATCH}, advice="lower args.count")

    def check_recipe(self, recipe, where: str) -> None:
        if recipe.target.of != "mlp":
            raise ValueError(f"{where}: toy_trim removes MLP channels; use target.of: mlp (got {recipe.target.of})")


def toy_trim(ctx: Context, args: ToyTrimArgs, layer: LayerView, stats: LayerStats) -> None:
    """Remove the last ``count`` MLP channels of the layer (a toy stage for the interface test)."""
    assert stats.block is not None and stats.input_norms is None  # no calibration read
    (group,) = build_groups(ctx.model, "mlp_channel", [layer.index])
    remove_units(ctx.model, group, list(range(group.size - args.count)))
    if layer.index == 0:
        ctx.report_stage("toy_trim", {"removed_per_layer": args.count, "propagate": stats.block.propagate})


@pytest.fixture
def registered():
    stage_names()  # the built-in stages first
    register_stage("toy_trim", ToyTrimArgs, "layer", paper="none (a test stage)")(toy_trim)
    yield
    STAGES.pop("toy_trim")


def recipe(model_dir, of: str = "mlp") -> dict:
    return {
        "name": "toy",
        "model": str(model_dir),
        "seed": 0,
        "target": {"ratio": 0.25, "of": of},  # 16 of the tiny Llama's 64 channels
        "stages": [{"stage": "toy_trim", "args": {"count": 16}}],
        "eval": {"perplexity": None},
    }


def test_a_stage_registered_outside_the_package_runs_end_to_end(registered, tiny_llama_dir, tmp_path):
    parsed = validate(recipe(tiny_llama_dir), "toy")
    assert parsed.stages[0].parsed_args() == ToyTrimArgs(count=16)
    with pytest.raises(SlimkitError, match=r"stages\.0: toy_trim removes MLP channels; use target.of: mlp"):
        validate(recipe(tiny_llama_dir, of="model"), "toy")

    model = slimkit.load(tiny_llama_dir)[0]
    plan = recipe_memory_plan(parsed, model.config, torch.float32)
    assert [(s.stage, s.parts) for s in plan.stages] == [("toy_trim", {"toy scratch": SCRATCH})]

    result = slimkit.run(parsed, tmp_path / "out")
    report = result.report
    assert report.target.met and report.target.achieved == pytest.approx(0.25)
    assert report.stages["toy_trim"].details == {"removed_per_layer": 16, "propagate": "dense"}
    written = report.as_json()
    assert written["memory_plan"]["stages"][0]["parts_gib"] == {"toy scratch": 1.0}
    assert written["calibration"] is None
    assert [w["intermediate_size"] for w in written["layers"]["after"]] == [48] * 3

    reloaded = slimkit.load(tmp_path / "out" / "model")[0]
    assert reloaded.model.layers[0].mlp.down_proj.weight.shape == (48, 48)
    ids = torch.randint(3, 200, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits)


def test_the_catalogue_lists_a_registered_stage(registered, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "stage", "list")
    assert code == 0, err
    assert re.search(r"toy_trim\W+layer\W+Remove the last", out), out
    code, out, err = run_cli(monkeypatch, capsys, "stage", "show", "toy_trim")
    assert code == 0, err
    assert "calibration data: no" in out and "count" in out
