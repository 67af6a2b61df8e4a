"""The support table (architecture x operation and x stage): generated from the code, printed by
``slimkit stage support``, and copied verbatim into docs/methods/architectures.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from slimkit.engine.support_table import (
    Reasons,
    architectures,
    decoder_stages,
    operation_table,
    stage_cell,
    support_markdown,
)
from slimkit.primitives.arch.capabilities import refusal
from slimkit.primitives.arch.spec import ARCH_SPECS
from slimkit.primitives.errors import SlimkitError
from slimkit.recipes.catalogue import stage_def
from tests.cli.test_catalogue import slimkit
from tests.tiny import tiny_gemma3_text, tiny_llama, tiny_olmo2

DOC = Path(__file__).resolve().parents[2] / "docs" / "methods" / "architectures.md"
BEGIN, END = "<!-- support table: begin -->", "<!-- support table: end -->"


def test_the_doc_holds_the_generated_table():
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert section == support_markdown(), "regenerate the section from `slimkit stage support`"


def test_the_cli_prints_the_table():
    result = slimkit("stage", "support")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == support_markdown()


def test_cells_follow_the_refusals():
    reasons = Reasons()
    assert set(architectures()) >= {"gemma", "gemma2", "gemma3_text", "granite", "olmo2", "llama", "qwen3"}
    assert "pca_project_post" not in decoder_stages() and "pca_project" in decoder_stages()
    assert stage_cell("pca_project", ARCH_SPECS["llama"], reasons) == "works"
    assert stage_cell("pca_project", ARCH_SPECS["gemma3_text"], reasons) == "refused [1]"
    assert "branch post-norms" in reasons.texts[0]
    cell = stage_cell("prune", ARCH_SPECS["olmo2"], reasons)
    assert cell.startswith("works; groups attention_head [2], kv_group [2]") and "whole q and k" in reasons.texts[1]
    assert refusal(ARCH_SPECS["gemma"], "mlp_channel") is None


@pytest.mark.parametrize(
    ("stage", "args", "factory", "message"),
    [
        ("pca_project", {}, tiny_gemma3_text, r"^the hidden-dimension projection is not supported for gemma3_text: "),
        ("prune", {"groups": ["attention_head"]}, tiny_olmo2, r"^attention_head groups are not supported for olmo2: "),
        ("cce", {"kinds": ["hidden_feature"]}, tiny_gemma3_text, r"^hidden_feature groups are not supported for gemma"),
        ("mask_train", {}, tiny_olmo2, r"^hidden-dimension masks are not supported for olmo2: "),
    ],
)
def test_a_stage_check_model_refuses_what_the_table_says(stage, args, factory, message):
    parsed = stage_def(stage).args.model_validate(args)
    with pytest.raises(SlimkitError, match=message):
        parsed.check_model(factory())
    parsed.check_model(tiny_llama())  # llama takes every operation


def test_a_refusal_the_config_decides_is_marked_where():
    """Phi-3's qk_dim refusal holds only where partial_rotary_factor < 1 (Phi-4-mini): the cell says so."""
    reasons = Reasons()
    lines = operation_table(reasons)
    phi3 = next(line for line in lines if line.startswith("| phi3 |"))
    number = reasons.texts.index(next(t for t in reasons.texts if t.startswith("where its partial_rotary_factor < 1")))
    assert f"| refused where [{number + 1}] |" in phi3 and phi3.count("where") == 1
