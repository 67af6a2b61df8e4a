"""primitives/evaluate/run.py: the evaluation dispatch, its timings and its refusals before any compute."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import EvalConfig, eval_options
from slimkit.primitives.evaluate.perplexity import perplexity
from slimkit.primitives.evaluate.run import (
    Evaluation,
    check_eval_length,
    check_lm_evaluations,
    evaluate_model,
    preflight_eval_data,
)


class Recorder:
    """A progress display that records each bar's description, total and advances."""

    def __init__(self) -> None:
        self.bars: list[list] = []

    @contextmanager
    def task(self, description: str, total: int | None):
        bar = [description, total, 0]
        self.bars.append(bar)

        def advance(n: int = 1) -> None:
            bar[2] += n

        yield advance


def test_timed_adds_up_the_seconds_of_a_label() -> None:
    result = Evaluation()
    with result.timed("eval:x"):
        pass
    first = result.seconds["eval:x"]
    with result.timed("eval:x"):
        pass
    assert result.seconds["eval:x"] >= first >= 0.0


def test_evaluate_model_gives_the_perplexity_of_the_windows(tokenizer) -> None:
    from tests.tiny import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer))
    config = eval_options("test", ["wikitext2"], seq_len=32, max_tokens=100)
    progress = Recorder()
    result = evaluate_model(model, tokenizer, config, progress)
    expected = perplexity(model, tokenizer, "wikitext2", seq_len=32, max_tokens=100, batch_size=4)
    assert result.metrics == {"wikitext2_ppl": pytest.approx(expected.perplexity)}
    assert progress.bars == [["perplexity wikitext2", 3, 3]]  # 100 tokens: three windows of 32
    assert result.details["perplexity"][0]["windows"] == 3 and "eval:wikitext2" in result.seconds


def test_nothing_configured_measures_nothing(tokenizer) -> None:
    result = evaluate_model(None, tokenizer, EvalConfig(perplexity=None))
    assert (result.metrics, result.details, result.seconds) == ({}, {}, {})


def test_windows_longer_than_the_model_positions_are_refused() -> None:
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    check_eval_length(eval_options("x", ["wikitext2"], seq_len=64), model)
    with pytest.raises(SlimkitError, match=r"--seq-len: 128 is longer than the model's max_position_embeddings \(64\)"):
        check_eval_length(eval_options("x", ["wikitext2"], seq_len=128), model)
    check_eval_length(eval_options("x", None, glue="sst2"), model)  # no perplexity: nothing to check
    check_eval_length(eval_options("x", ["wikitext2"], seq_len=128), SimpleNamespace())  # no limit known


def test_language_model_evaluations_of_an_encoder_are_refused_in_one_line() -> None:
    both = eval_options("x", ["wikitext2"], ["piqa"])
    with pytest.raises(SlimkitError) as refused:
        check_lm_evaluations(both, "bert", "use --glue")
    assert str(refused.value) == (
        "perplexity and zero-shot accuracy need a causal language model, and bert is an encoder; use --glue"
    )
    with pytest.raises(SlimkitError) as refused:
        check_lm_evaluations(both, "this run's model", "set {field}: null", field_prefix="eval.")
    assert str(refused.value) == (
        "eval.perplexity: needs a causal language model, and this run's model is an encoder; set eval.perplexity: null"
    )
    check_lm_evaluations(eval_options("x", None, glue="sst2"), "bert", "use --glue")  # GLUE alone: fine


def test_preflight_reads_the_data_files_first(monkeypatch) -> None:
    from slimkit.primitives.datasets import textdata

    read = []
    monkeypatch.setattr(textdata, "documents", lambda name: read.append(name))
    preflight_eval_data(eval_options("x", ["wikitext2", "ptb"]))
    assert read == ["wikitext2", "ptb"]
