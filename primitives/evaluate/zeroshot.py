"""Zero-shot multiple-choice accuracy through lm-evaluation-harness, on slimkit's shipped data only.

:func:`evaluate_zeroshot` runs lm-eval on the model object with task YAMLs that read local JSONL files; nothing
touches the network.

Method note: docs/methods/evaluate-zeroshot.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from slimkit.primitives.datasets.data_paths import cache_root, data_file
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.eval_settings import ZEROSHOT_BATCH_SIZE

__all__ = ["ZEROSHOT_TASKS", "check_request_lengths", "evaluate_zeroshot", "prepare_task_data"]

ZEROSHOT_TASKS: tuple[str, ...] = (
    "piqa",
    "hellaswag",
    "arc_easy",
    "arc_challenge",
    "boolq",
    "winogrande",
    "openbookqa",
)

# Bump when the prepared layout of any task changes, so old cache files are not reused.
_PREPARED_FORMAT = 1
_TEMPLATE_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
_TASK_PREFIX = "slimkit_"
_DATA_PLACEHOLDER = '"__SLIMKIT_DATA_FILE__"'
_HF_CACHE_PLACEHOLDER = '"__SLIMKIT_HF_CACHE__"'


# ----------------------------------------------------------------------------------------- readers


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SlimkitError(f"{path}: line {number} is not valid JSON ({exc.msg})") from exc
    return records


def _read_label_lines(path: Path) -> list[int]:
    with path.open(encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    try:
        return [int(line) for line in lines]
    except ValueError as exc:
        raise SlimkitError(f"{path}: every non-empty line must be an integer label ({exc})") from exc


def _check_count(task: str, records: list[Any], labels: list[Any], label_path: Path) -> None:
    if len(records) != len(labels):
        raise SlimkitError(
            f"{task}: {len(records)} records but {len(labels)} labels in {label_path}; the files do not align"
        )


def _prepare_piqa() -> list[dict[str, Any]]:
    docs = _read_jsonl(data_file("piqa/valid.jsonl"))
    label_path = data_file("piqa/valid-labels.lst")
    labels = _read_label_lines(label_path)
    _check_count("piqa", docs, labels, label_path)
    return [
        {"goal": doc["goal"], "sol1": doc["sol1"], "sol2": doc["sol2"], "label": label}
        for doc, label in zip(docs, labels, strict=True)
    ]


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's ``tasks/hellaswag/utils.py::preprocess``, verbatim."""
    text = text.strip()
    # Brackets are artifacts of the WikiHow part of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _prepare_hellaswag() -> list[dict[str, Any]]:
    out = []
    for doc in _read_jsonl(data_file("hellaswag/hellaswag_val_sample1000.jsonl")):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        out.append(
            {
                "ind": doc["ind"],
                "activity_label": doc["activity_label"],
                "query": _hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
                "choices": [_hellaswag_preprocess(ending) for ending in doc["endings"]],
                "label": int(doc["label"]),
                "gold": int(doc["label"]),
            }
        )
    return out


def _prepare_arc(file_name: str) -> list[dict[str, Any]]:
    out = []
    for doc in _read_jsonl(data_file(f"arc/{file_name}")):
        choices = doc["question"]["choices"]
        labels = [str(choice["label"]) for choice in choices]
        answer = str(doc["answerKey"]).strip()
        if answer not in labels:
            raise SlimkitError(f"arc/{file_name}: question {doc['id']} has answerKey {answer!r} not in {labels}")
        out.append(
            {
                "id": doc["id"],
                "question": doc["question"]["stem"],
                "choices": {"text": [choice["text"] for choice in choices], "label": labels},
                "answerKey": answer,
            }
        )
    return out


def _parse_bool_label(value: Any, where: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return int(value.strip().lower() == "true")
    raise SlimkitError(f"{where}: label {value!r} is not true/false")


def _prepare_boolq() -> list[dict[str, Any]]:
    path = data_file("boolq/val.jsonl")
    return [
        {
            "question": doc["question"],
            "passage": doc["passage"],
            "idx": doc.get("idx", number),
            # lm-eval's choices are ["no", "yes"]: false -> 0, true -> 1.
            "label": _parse_bool_label(doc["label"], f"{path} record {number}"),
        }
        for number, doc in enumerate(_read_jsonl(path))
    ]


def _prepare_winogrande() -> list[dict[str, Any]]:
    docs = _read_jsonl(data_file("winogrande/winogrande_dev_llmfoundry.jsonl"))
    label_path = data_file("winogrande/dev-labels.lst")
    labels = _read_label_lines(label_path)
    _check_count("winogrande", docs, labels, label_path)
    out = []
    for number, (doc, label) in enumerate(zip(docs, labels, strict=True)):
        gold = int(doc["gold"])
        if gold + 1 != label:
            raise SlimkitError(f"winogrande: record {number} has gold {gold} but {label_path} says {label}")
        options = list(doc["context_options"])
        if len(options) != 2:
            raise SlimkitError(f"winogrande: record {number} has {len(options)} context options, expected 2")
        # lm-eval strips the text after the blank (preprocess_winogrande.doc_to_target).
        out.append({"context_options": options, "continuation": doc["continuation"].strip(), "gold": gold})
    return out


def _prepare_openbookqa() -> list[dict[str, Any]]:
    out = []
    for number, doc in enumerate(_read_jsonl(data_file("openbookqa/openbook_qa_test_llmfoundry.jsonl"))):
        choices = list(doc["choices"])
        gold = int(doc["gold"])
        if len(choices) != 4 or not 0 <= gold < 4:
            raise SlimkitError(f"openbookqa: record {number} needs 4 choices and gold in 0..3")
        out.append(
            {
                "question_stem": doc["query"],
                "choices": {"text": choices, "label": ["A", "B", "C", "D"]},
                "answerKey": "ABCD"[gold],
            }
        )
    return out


# task -> (source files, relative to data_root(), that the prepared file depends on; preparer)
_TASKS: dict[str, tuple[tuple[str, ...], Callable[[], list[dict[str, Any]]]]] = {
    "piqa": (("piqa/valid.jsonl", "piqa/valid-labels.lst"), _prepare_piqa),
    "hellaswag": (("hellaswag/hellaswag_val_sample1000.jsonl",), _prepare_hellaswag),
    "arc_easy": (("arc/ARC-Easy-Test.jsonl",), lambda: _prepare_arc("ARC-Easy-Test.jsonl")),
    "arc_challenge": (("arc/ARC-Challenge-Test.jsonl",), lambda: _prepare_arc("ARC-Challenge-Test.jsonl")),
    "boolq": (("boolq/val.jsonl",), _prepare_boolq),
    "winogrande": (
        ("winogrande/winogrande_dev_llmfoundry.jsonl", "winogrande/dev-labels.lst"),
        _prepare_winogrande,
    ),
    "openbookqa": (("openbookqa/openbook_qa_test_llmfoundry.jsonl",), _prepare_openbookqa),
}
assert tuple(_TASKS) == ZEROSHOT_TASKS


# ------------------------------------------------------------------------------------ preparation


def _check_tasks(tasks: Any) -> list[str]:
    if isinstance(tasks, str):
        tasks = [tasks]
    names = list(dict.fromkeys(tasks))  # de-duplicate, keep order
    if not names:
        raise SlimkitError(f"no zero-shot task given; known: {', '.join(ZEROSHOT_TASKS)}")
    for name in names:
        if name not in _TASKS:
            raise SlimkitError(f"unknown zero-shot task {name!r}; known: {', '.join(ZEROSHOT_TASKS)}")
    return names


def _data_dir() -> Path:
    path = cache_root() / "lm_eval_data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def prepare_task_data(task: str) -> Path:
    """The normalised JSONL lm-eval reads for ``task`` (one of :data:`ZEROSHOT_TASKS`); built if missing.

    The file lives in ``cache_root() / "lm_eval_data"`` and is named ``<task>-<key>.jsonl``, where the key
    hashes the source files' paths, sizes and modification times and the prepared format, so a changed
    source gives a new file. It is written to a temporary sibling and renamed into place; stale files of
    the same task are removed.
    """
    (task,) = _check_tasks([task])
    sources, prepare = _TASKS[task]
    stamp = [_PREPARED_FORMAT, task]
    for relative in sources:
        path = data_file(relative)
        stat = path.stat()
        stamp.append([str(path), stat.st_size, stat.st_mtime_ns])
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    folder = _data_dir()
    target = folder / f"{task}-{key}.jsonl"
    if target.is_file():
        return target

    records = prepare()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{task}-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    for stale in folder.glob(f"{task}-*.jsonl"):
        if stale != target and re.fullmatch(rf"{re.escape(task)}-[0-9a-f]{{16}}\.jsonl", stale.name):
            with contextlib.suppress(OSError):
                stale.unlink()
    return target


def _render_tasks(names: list[str], include_dir: Path) -> None:
    hf_cache = cache_root() / "lm_eval_hf_datasets"
    hf_cache.mkdir(parents=True, exist_ok=True)
    for name in names:
        template_path = _TEMPLATE_DIR / f"{_TASK_PREFIX}{name}.yaml"
        try:
            template = template_path.read_text(encoding="utf-8")
        except OSError as exc:
            raise SlimkitError(f"lm-eval task template missing: {template_path} ({exc.strerror})") from exc
        # JSON string literals are valid double-quoted YAML scalars, whatever the path contains.
        text = template.replace(_DATA_PLACEHOLDER, json.dumps(str(prepare_task_data(name))))
        text = text.replace(_HF_CACHE_PLACEHOLDER, json.dumps(str(hf_cache)))
        (include_dir / template_path.name).write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------------- evaluation


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's INFO/WARNING chatter, the datasets progress bars and lm-eval's run-record extras off."""
    import datasets

    logger = logging.getLogger("lm_eval")
    old_level = logger.level
    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    logger.setLevel(logging.ERROR)
    datasets.utils.logging.disable_progress_bar()
    try:
        with contextlib.ExitStack() as stack:
            import lm_eval.evaluator

            # Run-record extras that simple_evaluate adds to its output: `git describe` in the working
            # directory (which prints "fatal: ..." outside a repository with commits) and torch's
            # collect_env report (seconds of subprocesses). Neither is used here.
            for name, stub in (("get_git_commit_hash", lambda: None), ("add_env_info", lambda storage: None)):
                if hasattr(lm_eval.evaluator, name):
                    stack.enter_context(mock.patch.object(lm_eval.evaluator, name, stub))
            # The bar of building each task's prompts (the requests' own bar stays): a refusal of a request
            # (check_request_lengths) is then one line, not a line after a finished bar.
            import lm_eval.api.task
            import tqdm

            if getattr(lm_eval.api.task, "tqdm", None) is tqdm.tqdm:
                silent = functools.partial(tqdm.tqdm, disable=True)
                stack.enter_context(mock.patch.object(lm_eval.api.task, "tqdm", silent))
            yield
    finally:
        logger.setLevel(old_level)
        if bars_were_on:
            datasets.utils.logging.enable_progress_bar()


@contextlib.contextmanager
def _untouched(model: Any) -> Iterator[None]:
    """Keep HFLM from changing the caller's model: it calls ``model.eval()`` and ``model.tie_weights()``.

    Re-tying would silently replace an lm_head that was changed apart from the embeddings of a model whose
    config still says ``tie_word_embeddings``; the training flag is restored afterwards.
    """
    was_training = getattr(model, "training", False)
    patch = (
        mock.patch.object(model, "tie_weights", lambda *args, **kwargs: None) if hasattr(model, "tie_weights") else None
    )
    try:
        with patch if patch is not None else contextlib.nullcontext():
            yield
    finally:
        if was_training and hasattr(model, "train"):
            model.train(True)


def _make_lm(model: Any, tokenizer: Any, batch_size: int) -> Any:
    from lm_eval.models.huggingface import HFLM

    class _LocalHFLM(HFLM):
        cut_contexts: dict[str, int]
        """Per task, the requests whose context lm-eval cuts from the left to fit the model's context."""

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            # Before any request is scored: a choice longer than the context is refused, a cut context counted.
            self.cut_contexts = check_request_lengths(self, requests)
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

        def get_model_info(self) -> dict:
            # HFLM's version asks the hub for the model's SHA; a model object has none.
            info: dict[str, Any] = {"model_num_parameters": sum(p.numel() for p in self._model.parameters())}
            info["model_dtype"] = str(getattr(self._model, "dtype", ""))
            return info

    return _LocalHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def check_request_lengths(lm: Any, requests: list[Any]) -> dict[str, int]:
    """Per task, how many of lm-eval's ``(context, choice)`` requests are longer than the model's context
    (``lm.max_length``): lm-eval cuts those contexts from the left with only a log warning, so the count is
    returned for the report's notes. A choice longer than the context by itself cannot be scored at all (lm-eval
    would stop on an assertion in the middle of the evaluation): refused here in one :class:`SlimkitError` line,
    before any request is scored. Tokenised as lm-eval's ``loglikelihood`` does (an empty context is one token)."""
    limit = int(lm.max_length)
    cut: dict[str, int] = {}
    for request in requests:
        context, choice = request.args
        if context:
            context_ids, choice_ids = lm._encode_pair(context, choice)  # lm-eval's own split of the pair
        else:
            context_ids, choice_ids = [lm.prefix_token_id], lm.tok_encode(choice, add_special_tokens=False)
        task = str(request.task_name).removeprefix(_TASK_PREFIX)
        if len(choice_ids) > limit:
            raise SlimkitError(
                f"zero-shot task {task}: a choice is {len(choice_ids)} tokens, longer than the model's context of "
                f"{limit} tokens; lm-eval cannot score it: drop {task} from the zero-shot tasks or use a model "
                "with a longer context"
            )
        if len(context_ids) + len(choice_ids) > limit + 1:
            cut[task] = cut.get(task, 0) + 1
    return cut


def evaluate_zeroshot(
    model: Any,
    tokenizer: Any,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = ZEROSHOT_BATCH_SIZE,
) -> dict[str, dict[str, float]]:
    """Zero-shot accuracy of a causal LM on the given tasks (see the module docstring for each task).

    Args:
        model: a ``transformers`` causal LM object (any device; it is evaluated where it is, in eval mode;
            its training flag is restored afterwards and HFLM's ``tie_weights()`` call is skipped).
        tokenizer: its tokenizer. lm-eval sets a pad token on it when it has none.
        tasks: names from :data:`ZEROSHOT_TASKS`; duplicates are ignored.
        limit: evaluate only the first ``limit`` records of each task (``None``: all).
        batch_size: lm-eval's batch size for the log-likelihood requests.

    Returns:
        ``{task: {"acc": ..., "acc_norm": ..., "n": ...}}`` keyed by the plain task names, in the order
        given; ``acc_norm`` is present for the tasks where lm-eval defines it (not boolq, winogrande),
        ``n`` is the number of records scored, ``cut_contexts`` (only when not 0) the number of requests whose
        context lm-eval cut from the left to fit the model's context (:func:`check_request_lengths`).

    Raises:
        SlimkitError: an unknown task, a bad ``limit``/``batch_size``, a missing data file, or a choice longer
            than the model's context (before any request is scored).
    """
    names = _check_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SlimkitError(f"limit must be a positive integer or None, got {limit!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SlimkitError(f"batch_size must be a positive integer, got {batch_size!r}")

    import lm_eval
    from lm_eval.tasks import TaskManager

    with _quiet():
        with tempfile.TemporaryDirectory(prefix="slimkit-lm-eval-") as include_dir:
            _render_tasks(names, Path(include_dir))
            task_manager = TaskManager(include_path=include_dir, include_defaults=False)
            with _untouched(model):
                lm = _make_lm(model, tokenizer, batch_size)
                started = time.perf_counter()
                output = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[_TASK_PREFIX + name for name in names],
                    task_manager=task_manager,
                    limit=limit,
                    num_fewshot=0,
                    batch_size=batch_size,
                    use_cache=None,
                    cache_requests=False,
                    bootstrap_iters=0,
                    check_integrity=False,
                    write_out=False,
                    log_samples=False,
                    apply_chat_template=False,
                    # Multiple-choice scoring draws no random numbers; leave the caller's RNG states alone.
                    random_seed=None,
                    numpy_random_seed=None,
                    torch_random_seed=None,
                )
                elapsed = time.perf_counter() - started
    if output is None:  # only non-zero ranks of a distributed run get None
        raise SlimkitError("lm-eval returned no results (not the main process of a distributed run?)")
    logging.getLogger(__name__).info("zero-shot evaluation of %s took %.1f s", names, elapsed)

    results: dict[str, dict[str, float]] = {}
    for name in names:
        internal = _TASK_PREFIX + name
        metrics = output["results"][internal]
        counts = output.get("n-samples", {}).get(internal, {})
        entry: dict[str, float] = {}
        for metric in ("acc", "acc_norm"):
            value = metrics.get(f"{metric},none")
            if value is not None and value != "N/A":
                entry[metric] = float(value)
        if "acc" not in entry or not all(math.isfinite(v) for v in entry.values()):
            raise SlimkitError(f"lm-eval gave no finite accuracy for {name}: {metrics}")
        entry["n"] = int(counts.get("effective", 0))
        cut = getattr(lm, "cut_contexts", {}).get(name)
        if cut:
            entry["cut_contexts"] = cut
        results[name] = entry
    return results
