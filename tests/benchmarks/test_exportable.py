"""benchmarks.exportable: every bundled LLM recipe, run on a tiny random Llama (the MoE recipes on a tiny Qwen3-MoE),
exported and read by llama.cpp.

One module-scoped run of all the LLM recipes (under a minute on two cores); the tests then read
its rows. Every recipe must run; every GGUF export must match PyTorch in llama.cpp within
:data:`benchmarks.exportable.TOLERANCE` or be refused with a one-line ``SlimkitError``; the verdicts
that follow from a recipe's structure (uniform widths, per-layer widths, low-rank pairs, residual
matrices between SP3 layer groups) are checked by name.
"""

from __future__ import annotations

import pytest

from benchmarks.exportable import EXPORTABLE, TOLERANCE, Row, run, table
from slimkit.recipes.loading import bundled_recipes

pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by make install")
pytestmark = pytest.mark.slow  # one run of every LLM recipe (about a minute of CPU)

BERT_RECIPES = {"sp3-bert", "cofi-bert", "glue-finetune"}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[dict[str, Row], dict[str, str]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("slimkit-cache")))
        rows, skipped = run(work=tmp_path_factory.mktemp("exportable"))
    print("\n" + table(rows, skipped))
    return {row.recipe: row for row in rows}, skipped


def test_every_llm_recipe_is_checked_and_only_bert_recipes_are_left_out(checked):
    rows, skipped = checked
    assert set(rows) | set(skipped) == set(bundled_recipes()) and not set(rows) & set(skipped)
    assert set(skipped) == BERT_RECIPES, skipped
    assert all("task" in reason or "minilm-l6" in reason for reason in skipped.values())
    lines = table(list(rows.values()), skipped).splitlines()
    assert len(lines) == 2 + len(rows) + len(skipped)
    assert all(row.exportable in EXPORTABLE for row in rows.values())


def test_every_recipe_runs_on_the_tiny_model(checked):
    rows, _ = checked
    failed = {name: row.run_error for name, row in rows.items() if row.run_error}
    assert not failed


def test_every_gguf_matches_llamacpp_or_is_refused_in_one_line(checked):
    rows, _ = checked
    for name, row in rows.items():
        assert not row.gguf_crash, f"{name}: {row.gguf_error}"
        if row.gguf is None:
            assert row.exportable == "no" and row.gguf_error and "\n" not in row.gguf_error, name
        else:
            assert row.llamacpp_error is None, f"{name}: {row.llamacpp_error}"
            assert row.rel_diff is not None and row.rel_diff <= TOLERANCE, f"{name}: {row.rel_diff}"
            assert row.gguf["architecture"] in ("llama", "deci", "qwen3moe") and row.gguf["type"] == "f32"
        assert row.gguf_ok, name


def test_structure_decides_the_format(checked):
    rows, _ = checked
    assert rows["wanda-channels"].exportable == "hf + gguf llama"  # uniform heads and MLP channels
    llm_pruner = rows["llm-pruner"]  # layers 0 and 3 left dense
    assert llm_pruner.exportable == "gguf deci" and "intermediate_size" in llm_pruner.why
    assert llm_pruner.hf is None and "\n" not in llm_pruner.hf_error and "--format gguf" in llm_pruner.hf_error
    lorap = rows["lorap"]
    assert lorap.exportable.endswith("(merged)") and "low-rank pairs" in lorap.gguf["merged"][0]
    assert lorap.gguf["added_params"] > 0
    sp3 = rows["sp3-oneshot"]  # two layer groups: a residual matrix between them
    assert sp3.exportable == "no" and "no exact merge" in sp3.gguf_error and "group_size: all" in sp3.gguf_error
    assert sp3.hf is None and "\n" not in sp3.hf_error
    sp3_lorap = rows["sp3+lorap"]  # one group: only the final norm's map, folded into the head
    assert sp3_lorap.exportable.endswith("(merged)")
    assert any("final norm" in item for item in sp3_lorap.gguf["merged"])
    for name in ("moe-expert-prune", "moe-expert-merge"):  # on the tiny Qwen3-MoE: uniform expert counts
        assert rows[name].exportable == "hf + gguf qwen3moe", (name, rows[name].why)
    for name, row in rows.items():  # a written hf folder was read back by stock transformers
        if row.hf is not None:
            assert row.hf["max_abs_logit_diff"] is not None and row.hf["max_abs_logit_diff"] < 1e-4, name


def test_the_run_reports_prediction_agrees_with_the_gguf_export(checked):
    """The folder's verdict (config and manifest only, :mod:`slimkit.primitives.export.plan`) and the export."""
    rows, _ = checked
    for name, row in rows.items():
        assert row.predicted_gguf is not None, name
        if row.gguf is None:
            assert row.predicted_gguf.startswith("no: "), f"{name}: {row.predicted_gguf}"
        else:
            assert row.predicted_gguf.startswith(f"yes: as gguf {row.gguf['architecture']}"), (
                f"{name}: {row.predicted_gguf}"
            )


def test_every_hf_export_is_written_or_refused_in_one_line_as_predicted(checked):
    """A hidden size that is not a multiple of the head count (cce*, llm-pruner-channel: 41 or 38 over 6 heads;
    smollm2's cce: 500 over 9) is refused by transformers' config class: one line, and predicted so."""
    rows, _ = checked
    for name, row in rows.items():
        assert not row.hf_crash and row.hf_ok, f"{name}: {row.hf_error}"
        if row.predicted_hf is not None:  # listed for folders stock transformers cannot read
            assert row.predicted_hf.startswith("yes: " if row.hf is not None else "no: "), f"{name}: {row.predicted_hf}"
    for name in ("cce", "llm-pruner-channel"):
        assert rows[name].exportable == "gguf llama" and "not a multiple" in rows[name].hf_error
