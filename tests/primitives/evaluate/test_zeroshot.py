"""Zero-shot evaluation through lm-eval on the shipped data (slimkit.primitives.evaluate.zeroshot).

A tiny random Llama with a byte-level BPE tokenizer trained here keeps the lm-eval run to seconds; the
prepared-data checks read the real files. Everything runs offline with a private cache folder.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from slimkit.primitives.datasets.data_paths import data_root
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.zeroshot import (
    ZEROSHOT_TASKS,
    evaluate_zeroshot,
    prepare_task_data,
)

EXPECTED_COUNTS = {
    "piqa": 1838,
    "hellaswag": 1000,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "boolq": 3270,
    "winogrande": 1267,
    "openbookqa": 500,
}
WITH_ACC_NORM = {"piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa"}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLIMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("slimkit-cache")))
        mp.delenv("SLIMKIT_DATA_DIR", raising=False)
        yield


def _records(task: str) -> list[dict]:
    with prepare_task_data(task).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _first_line(relative: str) -> str:
    with (data_root() / relative).open(encoding="utf-8") as handle:
        return handle.readline().strip()


def test_task_list():
    assert ZEROSHOT_TASKS == tuple(EXPECTED_COUNTS)


@pytest.mark.parametrize("task", list(EXPECTED_COUNTS))
def test_prepared_record_counts(task):
    records = _records(task)
    assert len(records) == EXPECTED_COUNTS[task]


def test_piqa_gold_from_separate_label_file():
    first = _records("piqa")[0]
    assert first["goal"].startswith("How do I ready a guinea pig cage")
    assert first["label"] == int(_first_line("piqa/valid-labels.lst"))
    assert {r["label"] for r in _records("piqa")} == {0, 1}


def test_boolq_string_labels_map_to_no_yes_order():
    with (data_root() / "boolq/val.jsonl").open(encoding="utf-8") as handle:
        raw = [json.loads(line) for line in handle]
    records = _records("boolq")
    # lm-eval's choices are ["no", "yes"]: "false" -> 0, "true" -> 1.
    assert raw[0]["label"] == "false" and records[0]["label"] == 0
    first_true = next(i for i, r in enumerate(raw) if r["label"] == "true")
    assert records[first_true]["label"] == 1
    assert sum(r["label"] for r in records) == 2033


def test_arc_letter_and_digit_labels():
    records = _records("arc_easy")
    first = records[0]
    assert first["choices"]["text"][first["choices"]["label"].index(first["answerKey"])].startswith("Sunlight")
    digit = next(r for r in records if r["choices"]["label"][0] == "1")
    assert digit["answerKey"] in digit["choices"]["label"]
    sizes = {len(r["choices"]["text"]) for r in records + _records("arc_challenge")}
    assert sizes == {3, 4, 5}


def test_winogrande_gold_matches_dev_labels():
    records = _records("winogrande")
    assert records[0]["gold"] + 1 == int(_first_line("winogrande/dev-labels.lst"))
    assert records[0]["context_options"][1].endswith("so Maria")
    assert records[0]["continuation"] == "always got the easier cases."


def test_openbookqa_matches_release_tsv():
    with (data_root() / "openbookqa/test.tsv").open(encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    records = _records("openbookqa")
    for row, record in zip(rows[:20], records[:20], strict=True):
        assert record["question_stem"] == row["Question Stem"]
        assert record["answerKey"] == row["Answer Key"]
    assert records[0]["choices"]["text"][1] == "quit eating lunch out"


def test_hellaswag_follows_lm_eval_preprocess():
    first = _records("hellaswag")[0]
    # activity_label + ": " + ctx_a + " " + ctx_b.capitalize(), as lm-eval's process_docs builds it.
    assert first["query"] == (
        "Pole vault: Pole vault is a sport where you run with a pole and stop and swing your body. A few women"
    )
    assert first["label"] == 3 and len(first["choices"]) == 4


def test_prepared_file_follows_its_source(tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(data_root() / "piqa", data / "piqa")
    monkeypatch.setenv("SLIMKIT_DATA_DIR", str(data))
    first = prepare_task_data("piqa")
    assert prepare_task_data("piqa") == first  # reused

    labels = (data / "piqa/valid-labels.lst").read_text().split("\n")
    labels[0] = str(1 - int(labels[0]))
    (data / "piqa/valid-labels.lst").write_text("\n".join(labels))
    os.utime(data / "piqa/valid-labels.lst", ns=(1, 1))
    second = prepare_task_data("piqa")
    assert second != first and not first.exists()
    assert json.loads(second.read_text().split("\n")[0])["label"] == int(labels[0])

    (data / "piqa/valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(SlimkitError, match="do not align"):
        prepare_task_data("piqa")


def test_missing_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMKIT_DATA_DIR", str(tmp_path))
    with pytest.raises(SlimkitError, match="data file missing"):
        prepare_task_data("boolq")


def test_unknown_task():
    with pytest.raises(SlimkitError, match=r"unknown zero-shot task 'mmlu'; known: piqa, hellaswag"):
        evaluate_zeroshot(None, None, ["piqa", "mmlu"])
    with pytest.raises(SlimkitError, match="limit"):
        evaluate_zeroshot(None, None, ["piqa"], limit=0)


def _tiny_model_and_tokenizer():
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "Question: which answer is right?\nAnswer: the first one.",
        "The man went to the store. Yes, no.",
    ]
    backend.train_from_iterator(corpus * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config), tokenizer


def test_evaluate_tiny_model_all_tasks():
    model, tokenizer = _tiny_model_and_tokenizer()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tasks = ["piqa", "arc_easy", "boolq", "winogrande", "hellaswag", "openbookqa", "arc_challenge"]

    results = evaluate_zeroshot(model, tokenizer, tasks, limit=4, batch_size=4)

    assert list(results) == tasks
    for task, metrics in results.items():
        assert metrics["n"] == 4, task
        assert ("acc_norm" in metrics) == (task in WITH_ACC_NORM), task
        for name in ("acc", "acc_norm"):
            if name in metrics:
                value = metrics[name]
                assert math.isfinite(value) and 0.0 <= value <= 1.0, (task, name, value)
                assert value * 4 == pytest.approx(round(value * 4)), (task, name, value)
    # The caller's model is left as it was.
    assert model.training
    assert "tie_weights" not in vars(model)
    after = model.state_dict()
    assert all(before[k].equal(after[k]) for k in before)


def test_contexts_cut_to_fit_the_model_are_counted_and_noted():
    """lm-eval cuts a context longer than the model's positions from the left with only a log warning: the count
    is in the results (``cut_contexts``) and a note of the evaluation, never silent; a fitting task has neither."""
    from types import SimpleNamespace

    from slimkit.primitives.evaluate.run import Evaluation, evaluate_zeroshot_tasks

    model, tokenizer = _tiny_model_and_tokenizer()
    model.config.max_position_embeddings = 120  # boolq passages are longer; "no"/"yes" fit
    result = Evaluation()
    settings = SimpleNamespace(tasks=["boolq", "winogrande"], limit=3, batch_size=4)
    evaluate_zeroshot_tasks(model, tokenizer, settings, result)
    results = result.details["zeroshot"]["results"]
    assert 0 < results["boolq"]["cut_contexts"] <= 3 * 2  # two choices per record
    assert "cut_contexts" not in results["winogrande"]
    (note,) = result.notes
    assert note.startswith(f"zero-shot boolq: {results['boolq']['cut_contexts']} requests were longer than")


def test_a_choice_longer_than_the_context_is_refused_before_scoring():
    model, tokenizer = _tiny_model_and_tokenizer()
    model.config.max_position_embeddings = 3
    scored = []
    model.register_forward_hook(lambda *args: scored.append(1))
    with pytest.raises(SlimkitError, match=r"^zero-shot task hellaswag: a choice is \d+ tokens, longer than"):
        evaluate_zeroshot(model, tokenizer, ["hellaswag"], limit=2)
    assert scored == []
