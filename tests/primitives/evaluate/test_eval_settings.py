"""primitives/evaluate/eval_settings.py: the evaluation settings, their defaults and the names they take."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import (
    PERPLEXITY_MAX_TOKENS,
    PERPLEXITY_SEQ_LEN,
    EvalConfig,
    GlueEval,
    PerplexityEval,
    ZeroshotEval,
    check_corpus,
    eval_options,
)


def test_defaults_are_wikitext2_perplexity_only() -> None:
    config = EvalConfig()
    assert config.perplexity == PerplexityEval()
    assert config.perplexity.datasets == ["wikitext2"]
    assert (config.perplexity.seq_len, config.perplexity.max_tokens) == (PERPLEXITY_SEQ_LEN, PERPLEXITY_MAX_TOKENS)
    assert config.zeroshot is None and config.glue is None and not config.speed


def test_names_outside_the_fixed_sets_are_refused_with_the_closest() -> None:
    assert check_corpus("wikitext2") == "wikitext2"
    with pytest.raises(ValidationError, match="unknown dataset 'wikitext'; did you mean 'wikitext2'"):
        PerplexityEval(datasets=["wikitext"])
    with pytest.raises(ValidationError, match="unknown zero-shot task 'piqq'; did you mean 'piqa'"):
        ZeroshotEval(tasks=["piqq"])
    with pytest.raises(ValidationError, match="unknown GLUE task 'sst'"):
        GlueEval(task="sst")
    with pytest.raises(ValidationError, match="unknown field 'perplexty'; did you mean 'perplexity'"):
        EvalConfig.model_validate({"perplexty": None})


def test_eval_options_builds_the_config_from_flat_options() -> None:
    config = eval_options("slimkit eval", ["ptb"], ["piqa"], limit=10, speed=True, seq_len=64, max_tokens=None)
    assert config.perplexity == PerplexityEval(datasets=["ptb"], seq_len=64, max_tokens=None)
    assert config.zeroshot == ZeroshotEval(tasks=["piqa"], limit=10) and config.speed and config.glue is None
    glue = eval_options("slimkit eval", None, glue="rte", limit=5)
    assert glue.perplexity is None and glue.glue == GlueEval(task="rte", limit=5)
    with pytest.raises(SlimkitError, match=r"^slimkit eval: perplexity\.seq_len: "):
        eval_options("slimkit eval", ["ptb"], seq_len=1)
