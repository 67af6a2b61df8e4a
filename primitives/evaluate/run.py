"""Running a model's configured evaluations: perplexity, zero-shot accuracy, GLUE dev metrics, throughput.

One dispatch for ``slimkit recipe run``, ``slimkit eval``, :func:`slimkit.evaluate` and the benchmarks. The
settings are an :class:`~slimkit.primitives.evaluate.eval_settings.EvalConfig` (a recipe's ``eval`` section);
progress bars come from any :class:`ProgressTasks` (the CLI's rich tracker, or none). Every bar shows its total.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import EvalConfig, GlueEval, PerplexityEval, ZeroshotEval

Advance = Callable[[int], None]


class ProgressTasks(Protocol):
    """What evaluation asks of a progress display: a bar with a description and a total."""

    def task(self, description: str, total: int | None) -> AbstractContextManager[Advance]: ...


@dataclass
class Evaluation:
    """What :func:`evaluate_model` returns: flat ``metrics`` (``wikitext2_ppl``, ``piqa_acc``, ...),
    per-evaluation ``details`` and the seconds each evaluation took (``eval:wikitext2``, ``eval:zeroshot``, ...)."""

    metrics: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What a reader of the numbers must know (e.g. contexts lm-eval cut to fit the model): the report's notes."""

    @contextmanager
    def timed(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start


def _no_advance(_n: int = 1) -> None:
    return None


class NoProgress:
    """A :class:`ProgressTasks` that shows nothing."""

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        yield _no_advance


def preflight_eval_data(config: EvalConfig) -> None:
    """Read every data file the evaluations will need now, so a missing one (or an unusable cache folder, which
    the datasets library and the zero-shot tasks write to) fails before any compute."""
    from slimkit.primitives.datasets import gluedata, textdata
    from slimkit.primitives.datasets.data_paths import cache_root

    if config.perplexity is not None or config.zeroshot is not None:
        cache_root()  # usable: checked even when the corpora were read earlier in this process
    if config.perplexity is not None:
        for dataset in config.perplexity.datasets:
            textdata.documents(dataset)
    if config.zeroshot is not None:
        from slimkit.primitives.evaluate.zeroshot import prepare_task_data

        for task in config.zeroshot.tasks:
            prepare_task_data(task)
    if config.glue is not None and config.glue.task is not None:
        gluedata.read_split(config.glue.task, "dev")


def check_eval_length(config: EvalConfig, model: Any, setting: str = "--seq-len") -> None:
    """Refuse perplexity windows longer than the model's positions (its ``max_position_embeddings``), which would
    print a number without a word; ``setting`` names the setting in the line."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if config.perplexity is None or not isinstance(limit, int) or config.perplexity.seq_len <= limit:
        return
    raise SlimkitError(
        f"{setting}: {config.perplexity.seq_len} is longer than the model's max_position_embeddings ({limit}); "
        f"use at most {limit}"
    )


def check_eval_model(settings: EvalConfig, model: Any, task_head: bool) -> None:
    """Refuse perplexity or zero-shot evaluation of an encoder (no language-model head) unless the recipe gives it a
    task head, and perplexity windows longer than the model's positions (``eval.`` fields named)."""
    from slimkit.primitives.arch.support import task_of

    check_eval_length(settings, model, "eval.perplexity.seq_len")
    encoder = task_of(model.config) == "encoder"
    if not task_head and not encoder:
        check_lm_head(settings, model, "the recipe's model")
    if task_head or not encoder:
        return
    remedy = "set {field}: null, or give the recipe a GLUE task (task: sst2) and eval.glue"
    check_lm_evaluations(settings, "this run's model", remedy, field_prefix="eval.")


def check_lm_head(config: EvalConfig, model: Any, what: str = "the model") -> None:
    """Refuse perplexity and zero-shot evaluation of a model built without a language-model head (a config whose
    ``architectures`` names the bare ``LlamaModel`` class, say): it gives hidden states, not next-token logits."""
    wanted = [name for name, setting in (("perplexity", config.perplexity), ("zero-shot", config.zeroshot)) if setting]
    get_head = getattr(model, "get_output_embeddings", None)
    if not wanted or (callable(get_head) and get_head() is not None):
        return
    raise SlimkitError(
        f"{what} was built as {type(model).__name__}, which has no language-model head (its config.json's "
        f"architectures names that class), so {' and '.join(wanted)} cannot be measured; name a causal LM class "
        "there (e.g. LlamaForCausalLM) or leave architectures out"
    )


LM_EVALUATIONS: dict[str, str] = {"perplexity": "perplexity", "zeroshot": "zero-shot accuracy"}
"""The evaluations that read a language-model head (an ``eval`` field and what it measures)."""


def check_lm_evaluations(config: EvalConfig, model: str, remedy: str, field_prefix: str | None = None) -> None:
    """Refuse, in one line, perplexity or zero-shot evaluation of a model the caller knows is an encoder (it has no
    language-model head). ``model`` names it; ``remedy`` says what to do instead (``{field}``: the first refused
    setting's name); ``field_prefix`` (a recipe's ``eval.``) names the settings as fields, else as what they
    measure."""
    wanted = [field for field in LM_EVALUATIONS if getattr(config, field) is not None]
    if not wanted:
        return
    if field_prefix is not None:
        field = f"{field_prefix}{wanted[0]}"
        subject = f"{field}: needs"
    else:
        field = wanted[0]
        names = [LM_EVALUATIONS[name] for name in wanted]
        subject = f"{' and '.join(names)} {'needs' if len(names) == 1 else 'need'}"
    raise SlimkitError(f"{subject} a causal language model, and {model} is an encoder; {remedy.format(field=field)}")


def check_tokenizer(config: EvalConfig, tokenizer: Any, what: str = "the model") -> None:
    """Refuse, before any compute, evaluations without the model's tokenizer (every one reads text or its size)."""
    wanted = [name for name in ("perplexity", "zeroshot", "glue") if getattr(config, name)] + (
        ["speed"] if config.speed else []
    )
    if wanted and tokenizer is None:
        raise SlimkitError(
            f"{what} has no tokenizer, and {', '.join(wanted)} evaluation tokenises text with it: give the model's "
            "tokenizer (a model folder holds tokenizer.json or tokenizer_config.json)"
        )


def evaluate_model(model, tokenizer, config: EvalConfig, progress: ProgressTasks | None = None) -> Evaluation:
    """Run the configured evaluations of ``model``."""
    check_tokenizer(config, tokenizer)
    progress = progress or NoProgress()
    result = Evaluation()
    if config.perplexity is not None:
        evaluate_perplexity(model, tokenizer, config.perplexity, progress, result)
    if config.zeroshot is not None and config.zeroshot.tasks:
        evaluate_zeroshot_tasks(model, tokenizer, config.zeroshot, result)
    if config.glue is not None:
        evaluate_glue_task(model, tokenizer, config.glue, progress, result)
    if config.speed:
        from slimkit.primitives.evaluate.speed import throughput

        with result.timed("eval:speed"):
            result.details["speed"] = throughput(model, len(tokenizer)).as_dict()
    return result


def evaluate_perplexity(
    model, tokenizer, settings: PerplexityEval, progress: ProgressTasks, result: Evaluation
) -> None:
    """``<dataset>_ppl`` for each dataset; its bar counts the evaluation windows."""
    from slimkit.primitives.datasets import textdata
    from slimkit.primitives.evaluate.perplexity import (
        PerplexityResult,
        bos_prefix,
        corpus_ids,
        perplexity_of_windows,
        windows_of,
    )

    result.details["perplexity"] = []
    for dataset in settings.datasets:
        with result.timed(f"eval:{dataset}"):
            ids = corpus_ids(tokenizer, textdata.text(dataset), settings.max_tokens)
            windows = windows_of(ids, settings.seq_len, settings.max_tokens, bos_prefix(tokenizer))
            with progress.task(f"perplexity {dataset}", int(windows.shape[0])) as advance:
                value = perplexity_of_windows(model, windows, settings.batch_size, advance)
        measured = PerplexityResult(dataset, value, int(windows.shape[0]), settings.seq_len, int(windows.numel()))
        result.metrics[f"{dataset}_ppl"] = measured.perplexity
        result.details["perplexity"].append(measured.as_dict())


def evaluate_zeroshot_tasks(model, tokenizer, settings: ZeroshotEval, result: Evaluation) -> None:
    """``<task>_acc`` (and ``_acc_norm``) through lm-eval (its own bars count the requests), and
    ``zeroshot_mean_acc``."""
    from slimkit.primitives.evaluate.zeroshot import evaluate_zeroshot

    with result.timed("eval:zeroshot"):
        results = evaluate_zeroshot(
            model, tokenizer, settings.tasks, limit=settings.limit, batch_size=settings.batch_size
        )
    result.details["zeroshot"] = {"limit": settings.limit, "results": results}
    for task, values in results.items():
        if values.get("cut_contexts"):
            result.notes.append(
                f"zero-shot {task}: {values['cut_contexts']} requests were longer than the model's context; lm-eval "
                "cut their contexts from the left, so the accuracy is not lm-eval's standard one"
            )
        for key in ("acc", "acc_norm"):
            if key in values:
                result.metrics[f"{task}_{key}"] = values[key]
    result.metrics["zeroshot_mean_acc"] = sum(v["acc"] for v in results.values()) / len(results)


def evaluate_glue_task(model, tokenizer, settings: GlueEval, progress: ProgressTasks, result: Evaluation) -> None:
    """GLUE dev metrics as ``glue_<task>_<metric>``; the task is the settings', else the one the model records."""
    from slimkit.primitives.datasets import gluedata
    from slimkit.primitives.evaluate.glue_metrics import evaluate_glue

    task = settings.task or getattr(getattr(model, "config", None), "finetuning_task", None)
    if task is None:
        raise SlimkitError("eval.glue: no task given and the model records none; name one (e.g. --glue sst2)")
    total = len(gluedata.load_examples(task, "dev", settings.limit))
    with result.timed(f"eval:glue_{task}"), progress.task(f"glue {task}", total) as advance:
        measured = evaluate_glue(
            model, tokenizer, task, settings.limit, settings.batch_size, settings.max_length, advance
        )
    result.details["glue"] = measured
    result.metrics.update({f"glue_{task}_{key}": measured[key] for key in gluedata.glue_task(task).metrics})
