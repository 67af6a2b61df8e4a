"""A stage defined outside the package runs end to end with no edit to the engine: the stage protocol is complete.

``toy_trim`` (a layer stage) removes the last ``count`` MLP channels of every layer. It is a class with typed methods
(:class:`~slimkit.engine.stage.LayerStage`: ``start`` returns its own state, ``run_layer`` acts on one layer,
``finish`` returns its :class:`~slimkit.engine.stage.StageResult`), and its arguments offer only the capabilities it
has: a share of the target with its plan, the projections it touches, its memory, its check against the rest of the
recipe. The test registers it, validates a recipe using it (and one it refuses), makes the memory plan, runs it on a
tiny Llama, saves and reloads the result, reads the report, and finds it in ``slimkit stage list`` and ``slimkit
stage show``. A stage that removes nothing and reads nothing needs no capability at all (``toy_note``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
from pydantic import Field

import slimkit
from slimkit.engine.capabilities import PlansMemory, PlansRemoval
from slimkit.engine.context import Context
from slimkit.engine.layer_stats import LayerStats
from slimkit.engine.memory_check import recipe_memory_plan
from slimkit.engine.registry import register_stage
from slimkit.engine.stage import StageResult
from slimkit.engine.stage_memory import MemoryInputs
from slimkit.primitives.arch import LayerView
from slimkit.primitives.device.memory_model import GIB, StageMemory
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.groups import build_groups
from slimkit.primitives.io.load import read_manifest
from slimkit.primitives.surgery import remove_units
from slimkit.recipes.catalogue import STAGES, stage_names
from slimkit.recipes.loading import validate
from slimkit.recipes.stage_args import BudgetMode, ChangesProjections, ChecksRecipe, SharesTarget, StageArgs
from tests.cli.test_cli import run_cli

SCRATCH = GIB
"""The toy stage's declared scratch memory (one GiB: visible in the plan's two-decimal GiB)."""


class ToyTrimArgs(StageArgs, SharesTarget, PlansRemoval, ChangesProjections, PlansMemory, ChecksRecipe):
    count: int = Field(16, ge=1)
    """MLP channels removed from the end of every layer."""

    def budget(self) -> BudgetMode:
        return "explicit"

    def plan(self, ctx: Context) -> int:
        layer = ctx.view.layer(0)
        return self.count * 3 * layer.linear("down").weight.shape[0] * ctx.view.num_layers

    def touches(self) -> frozenset:
        return frozenset({"gate", "up", "down"})

    def memory(self, stage: str, inputs: MemoryInputs) -> StageMemory:
        return StageMemory(stage, {"toy scratch": SCRATCH}, advice="lower args.count")

    def check_recipe(self, recipe, where: str) -> None:
        if recipe.target.of != "mlp":
            raise ValueError(f"{where}: toy_trim removes MLP channels; use target.of: mlp (got {recipe.target.of})")


@dataclass
class ToyTrimState:
    ctx: Context
    args: ToyTrimArgs
    widths: dict[int, int] = field(default_factory=dict)


class ToyTrim:
    """Remove the last ``count`` MLP channels of every layer (a toy stage for the protocol test)."""

    def start(self, ctx: Context, args: ToyTrimArgs) -> ToyTrimState:
        return ToyTrimState(ctx, args)

    def run_layer(self, state: ToyTrimState, layer: LayerView, stats: LayerStats) -> None:
        assert stats.block is not None and stats.input_norms is None  # no calibration read
        (group,) = build_groups(state.ctx.model, "mlp_channel", [layer.index])
        remove_units(state.ctx.model, group, list(range(group.size - state.args.count)))
        state.widths[layer.index] = group.size - state.args.count

    def finish(self, state: ToyTrimState) -> StageResult:
        return StageResult({"removed_per_layer": state.args.count, "widths": state.widths})


class ToyNoteArgs(StageArgs):
    text: str = "hello"
    """What the stage writes in the report."""


class ToyNote:
    """Write a note in the report (a model stage that needs no capability)."""

    def run_model(self, ctx: Context, args: ToyNoteArgs) -> StageResult:
        return StageResult({"text": args.text}, manifest={"toy_note": args.text})


@pytest.fixture
def registered():
    stage_names()  # the built-in stages first
    register_stage("toy_trim", ToyTrimArgs, paper="none (a test stage)")(ToyTrim)
    register_stage("toy_note", ToyNoteArgs)(ToyNote)
    yield
    STAGES.pop("toy_trim")
    STAGES.pop("toy_note")


def recipe(model_dir, of: str = "mlp") -> dict:
    return {
        "name": "toy",
        "model": str(model_dir),
        "seed": 0,
        "target": {"ratio": 0.25, "of": of},  # 16 of the tiny Llama's 64 channels
        "stages": [{"stage": "toy_trim", "args": {"count": 16}}, {"stage": "toy_note"}],
        "eval": {"perplexity": None},
    }


def test_a_stage_registered_outside_the_package_runs_end_to_end(registered, tiny_llama_dir, tmp_path):
    parsed = validate(recipe(tiny_llama_dir), "toy")
    assert parsed.stages[0].parsed_args() == ToyTrimArgs(count=16)
    with pytest.raises(SlimkitError, match=r"stages\.0: toy_trim removes MLP channels; use target.of: mlp"):
        validate(recipe(tiny_llama_dir, of="model"), "toy")

    model = slimkit.load(tiny_llama_dir)[0]
    plan = recipe_memory_plan(parsed, model.config, torch.float32)
    assert [(s.stage, s.parts) for s in plan.stages] == [("toy_trim", {"toy scratch": SCRATCH}), ("toy_note", {})]

    result = slimkit.run(parsed, tmp_path / "out")
    report = result.report
    assert report.target.met and report.target.achieved == pytest.approx(0.25)
    assert report.stages["toy_trim"].details == {"removed_per_layer": 16, "widths": {0: 48, 1: 48, 2: 48}}
    assert report.stages["toy_note"].details == {"text": "hello"}
    written = report.as_json()
    assert written["memory_plan"]["stages"][0]["parts_gib"] == {"toy scratch": 1.0}
    assert written["calibration"] is None
    assert written["stages"]["toy_trim"]["widths"] == {"0": 48, "1": 48, "2": 48}
    assert [w["intermediate_size"] for w in written["layers"]["after"]] == [48] * 3

    reloaded, _tokenizer = slimkit.load(tmp_path / "out" / "model")
    assert reloaded.model.layers[0].mlp.down_proj.weight.shape == (48, 48)
    manifest = read_manifest(tmp_path / "out" / "model")
    assert manifest is not None and manifest["toy_note"] == "hello"
    ids = torch.randint(3, 200, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model(ids).logits)


def test_a_class_that_is_no_stage_or_hides_a_capability_is_refused_when_it_registers(registered):
    class Nothing:
        """Neither run_model nor run_layer."""

    with pytest.raises(TypeError, match="has neither run_model nor start/run_layer/finish"):
        register_stage("nothing", ToyNoteArgs)(Nothing)

    class Hidden(StageArgs):
        def needs_calibration(self) -> bool:
            return True

    with pytest.raises(TypeError, match=r"needs_calibration \(ReadsData\) without inheriting the capability"):
        register_stage("hidden", Hidden)(ToyNote)
    assert "nothing" not in STAGES and "hidden" not in STAGES


def test_the_catalogue_lists_a_registered_stage(registered, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "stage", "list")
    assert code == 0, err
    assert re.search(r"toy_trim\W+layer\W+Remove the last", out), out
    assert re.search(r"toy_trim.*module ([\w.]+\.)?tests\.contracts\.test_toy_stage", out.replace("\n", " ")), out
    code, out, err = run_cli(monkeypatch, capsys, "stage", "show", "toy_trim")
    assert code == 0, err
    assert "calibration data: no" in out and "count" in out
    assert re.search(r"from: module ([\w.]+\.)?tests\.contracts\.test_toy_stage", out), out
