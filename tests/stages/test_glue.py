"""GLUE: data from the shipped TSVs, metrics, task models, fine-tuning, save/load, recipes and CLI."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

import slimkit
from slimkit.primitives.calibration import CalibrationSpec, calibration_batches
from slimkit.primitives.datasets import gluedata
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate.glue_metrics import (
    average_ranks,
    evaluate_glue,
    f1_score,
    glue_metrics,
    pearson,
    spearman,
)
from slimkit.primitives.finetune.glue_task_model import GlueFinetuneConfig, finetune_glue, task_model
from slimkit.recipes.loading import validate
from tests.cli.test_cli import assert_one_line_error, run_cli
from tests.tiny import tiny_bert, tiny_llama

# ---- data -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "split", "count"),
    [
        ("sst2", "dev", 872),
        ("mrpc", "train", 3668),
        ("mrpc", "dev", 408),
        ("rte", "train", 2490),
        ("rte", "dev", 277),
        ("stsb", "train", 5749),
        ("stsb", "dev", 1500),
    ],
)
def test_split_sizes_match_glue(task, split, count):
    assert len(gluedata.read_split(task, split)) == count


def test_labels_and_texts_as_glue_defines_them():
    rte = gluedata.read_split("rte", "dev")
    assert Counter(e.label for e in rte) == {0: 146, 1: 131}  # 0 entailment, 1 not_entailment
    assert rte[0].text_b == "Christopher Reeve had an accident." and rte[0].label == 1
    sst2 = gluedata.read_split("sst2", "dev")
    assert sst2[0] == gluedata.GlueExample("it 's a charming and often affecting journey . ", None, 1)
    stsb = gluedata.read_split("stsb", "dev")
    assert stsb[0].label == 5.0 and all(0.0 <= e.label <= 5.0 for e in stsb)
    assert Counter(e.label for e in gluedata.read_split("mrpc", "train")) == {1: 2474, 0: 1194}


def test_mrpc_train_is_rebuilt_from_the_microsoft_file():
    rebuilt = {(e.text_a, e.text_b) for e in gluedata.read_split("mrpc", "train")}
    _, shipped = gluedata._rows("glue/MRPC/train.tsv")
    assert len(shipped) == 3667 and {(r[3], r[4]) for r in shipped} < rebuilt
    assert not rebuilt & {(e.text_a, e.text_b) for e in gluedata.read_split("mrpc", "dev")}


def test_subsets_first_or_seeded():
    dev = gluedata.read_split("rte", "dev")
    assert gluedata.load_examples("rte", "dev", 5) == list(dev[:5])
    drawn = gluedata.load_examples("rte", "dev", 20, seed=3)
    assert drawn == gluedata.load_examples("rte", "dev", 20, seed=3)
    assert drawn != gluedata.load_examples("rte", "dev", 20, seed=4)
    assert len(set(drawn)) == 20 and set(drawn) <= set(dev)
    with pytest.raises(SlimkitError, match="unknown GLUE task 'qnli'; allowed: sst2, mrpc, rte, stsb"):
        gluedata.read_split("qnli", "dev")
    with pytest.raises(SlimkitError, match="unknown split 'test'"):
        gluedata.read_split("rte", "test")


def test_encode_pairs_and_regression_labels(tokenizer):
    examples = gluedata.load_examples("stsb", "dev", 3)
    batch = gluedata.encode(tokenizer, examples, max_length=24)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == [5.0, 4.75, 5.0]
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["input_ids"].shape[1] <= 24
    single = gluedata.encode(tokenizer, gluedata.load_examples("sst2", "dev", 4), max_length=200)
    lengths = single["attention_mask"].sum(1)
    assert single["labels"].dtype == torch.long and lengths.max() == single["input_ids"].shape[1]
    assert lengths.tolist() == [len(tokenizer(e.text_a).input_ids) for e in gluedata.load_examples("sst2", "dev", 4)]


def test_calibration_packs_task_examples(tokenizer):
    spec = CalibrationSpec(dataset="glue-rte", samples=6, seq_len=32, seed=1, examples=20)
    ids = calibration_batches(tokenizer, spec)
    assert ids.shape == (6, 32) and ids.dtype == torch.long
    torch.testing.assert_close(ids, calibration_batches(tokenizer, spec))
    stream = []
    for e in gluedata.load_examples("rte", "train", 20, seed=1):
        stream += tokenizer(e.text_a, e.text_b, truncation=True, max_length=128).input_ids
    windows = {tuple(stream[i : i + 32]) for i in range(0, len(stream) - 31, 32)}
    assert all(tuple(row) in windows for row in ids.tolist())
    assert spec.describe()["examples"] == 20 and "examples" not in CalibrationSpec("c4").describe()
    with pytest.raises(SlimkitError, match=r"raise calibration\.examples"):
        calibration_batches(tokenizer, CalibrationSpec(dataset="glue-sst2", samples=50, seq_len=64, examples=8))


# ---- metrics ----------------------------------------------------------------------------------


def test_metrics_by_hand():
    x, y = torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0, 4.0])
    assert average_ranks(x).tolist() == [1.0, 2.5, 2.5, 4.0]
    # ranks [1, 2.5, 2.5, 4] vs [1, 3, 2, 4]: centred products 4.5, norms^2 4.5 and 5
    assert spearman(x, y) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 8.0, 27.0])) == pytest.approx(1.0)
    assert pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])) == pytest.approx(
        5.0 / (2.0 * (38 / 3)) ** 0.5  # centred [-1, 0, 1] and [-7/3, -1/3, 8/3]
    )
    assert pearson(torch.ones(3), torch.arange(3.0)) == 0.0
    predictions, labels = torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1])
    assert f1_score(predictions, labels) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert glue_metrics("mrpc", logits, labels) == {"accuracy": pytest.approx(0.6), "f1": pytest.approx(2 / 3)}
    assert set(glue_metrics("stsb", torch.tensor([[0.1], [0.5], [0.2]]), torch.tensor([1.0, 3.0, 2.0]))) == {
        "spearman",
        "pearson",
    }


def test_spearman_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 6, (50,), generator=generator).float()
    y = x + torch.randn(50, generator=generator)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy()).statistic)


# ---- task models, fine-tuning, save/load ------------------------------------------------------


def test_task_model_wraps_the_encoder(tokenizer):
    encoder = tiny_bert(vocab_size=len(tokenizer))
    layer_weight = encoder.encoder.layer[0].attention.self.query.weight
    model = task_model(encoder, "stsb", seed=1)
    assert isinstance(model, BertForSequenceClassification) and model.bert is encoder
    assert model.bert.encoder.layer[0].attention.self.query.weight is layer_weight
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    assert model.config.finetuning_task == "stsb" and model.config.architectures == ["BertForSequenceClassification"]
    again = task_model(tiny_bert(vocab_size=len(tokenizer)), "stsb", seed=1)
    other = task_model(tiny_bert(vocab_size=len(tokenizer)), "stsb", seed=2)
    torch.testing.assert_close(model.classifier.weight, again.classifier.weight)
    torch.testing.assert_close(model.bert.pooler.dense.weight, again.bert.pooler.dense.weight)
    assert not torch.equal(model.classifier.weight, other.classifier.weight)
    assert task_model(model, "stsb") is model
    with pytest.raises(SlimkitError, match="GLUE sst2 needs num_labels=2, the model has 1"):
        task_model(model, "sst2")
    with pytest.raises(SlimkitError, match="the model was fine-tuned for GLUE sst2, not rte"):
        task_model(task_model(tiny_bert(vocab_size=len(tokenizer)), "sst2"), "rte")
    with pytest.raises(SlimkitError, match="need an encoder model"):
        task_model(tiny_llama(), "sst2")


def test_finetuning_reduces_the_loss(tokenizer):
    torch.manual_seed(0)  # the tiny encoder's random weights must not depend on which tests ran before
    model = task_model(tiny_bert(vocab_size=len(tokenizer)), "sst2", seed=0)
    config = GlueFinetuneConfig(
        "sst2", learning_rate=3e-3, epochs=10, max_steps=20, batch_size=8, max_length=48, train_examples=16, seed=0
    )
    initial = copy.deepcopy(model)
    report = finetune_glue(model, tokenizer, config)
    assert report["steps"] == 20 and report["epochs"] == pytest.approx(10.0) and not model.training
    assert sum(report["losses"][-3:]) / 3 < 0.7 * sum(report["losses"][:3]) / 3
    assert finetune_glue(initial, tokenizer, config)["losses"] == report["losses"]
    with pytest.raises(SlimkitError, match="glue_finetune: learning_rate must be > 0"):
        GlueFinetuneConfig("sst2", learning_rate=0.0)


def test_saved_task_model_reloads_with_equal_logits(tmp_path, tokenizer):
    model = task_model(tiny_bert(vocab_size=len(tokenizer)), "rte", seed=0)
    finetune_glue(model, tokenizer, GlueFinetuneConfig("rte", learning_rate=1e-3, max_steps=2, batch_size=4))
    slimkit.save(model, tokenizer, tmp_path / "m")
    loaded, loaded_tokenizer = slimkit.load(tmp_path / "m")
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    assert isinstance(loaded, BertForSequenceClassification) and loaded.config.finetuning_task == "rte"
    batch = gluedata.encode(tokenizer, gluedata.load_examples("rte", "dev", 4), max_length=64)
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)
        torch.testing.assert_close(plain(**batch).logits, model(**batch).logits)
    first = evaluate_glue(model, tokenizer, "rte", limit=8, batch_size=4, max_length=64)
    assert (
        evaluate_glue(loaded, loaded_tokenizer, "rte", limit=8, batch_size=4, max_length=64)["accuracy"]
        == (first["accuracy"])
    )
    assert first["examples"] == 8 and 0.0 <= first["accuracy"] <= 1.0


def test_evaluation_needs_a_task_model(tokenizer):
    with pytest.raises(SlimkitError, match="needs a sequence-classification model, got BertModel"):
        evaluate_glue(tiny_bert(vocab_size=len(tokenizer)), tokenizer, "sst2", limit=2)
    stsb = task_model(tiny_bert(vocab_size=len(tokenizer)), "stsb")
    with pytest.raises(SlimkitError, match="GLUE sst2 needs num_labels=2, the model has 1"):
        evaluate_glue(stsb, tokenizer, "sst2", limit=2)


# ---- recipes, runner, CLI ---------------------------------------------------------------------


@pytest.fixture
def tiny_bert_dir(tmp_path, tokenizer):
    path = tmp_path / "tiny-bert"
    tiny_bert(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def glue_recipe(model_dir, **changes) -> dict:
    recipe = {
        "name": "tiny-glue",
        "model": str(model_dir),
        "task": "sst2",
        "target": {"ratio": 0.0},
        "stages": [
            {
                "stage": "glue_finetune",
                "args": {"max_steps": 3, "batch_size": 8, "max_length": 32, "learning_rate": 1e-3},
            }
        ],
        "eval": {"glue": {"limit": 16, "batch_size": 8, "max_length": 32}},
    }
    recipe.update(changes)
    return recipe


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "qnli"}, "task: unknown GLUE task 'qnli'; allowed: sst2, mrpc, rte, stsb"),
        ({"task": None}, "stages.0: stage 'glue_finetune' needs the recipe's task"),
        ({"eval": {"glue": {"task": "cola"}}}, "eval.glue.task: unknown GLUE task 'cola'"),
        ({"eval": {"glue": {"task": "rte"}}}, "eval.glue.task: the recipe's task is sst2"),
        ({"eval": {"perplexity": {}}}, "eval.perplexity: a GLUE task model has no language-model head"),
        ({"calibration": {"dataset": "glue-qnli"}}, "calibration.dataset: unknown dataset 'glue-qnli'; allowed:"),
        ({"calibration": {"dataset": "c4", "examples": 64}}, "examples: applies to GLUE calibration datasets"),
        ({"task": None, "stages": [{"stage": "lora"}], "calibration": {"dataset": "glue"}}, "glue means the recipe"),
        ({"stages": [{"stage": "glue_finetune", "args": {"epochs": 0}}]}, "args.epochs: Input should be greater"),
    ],
)
def test_glue_recipe_errors(tmp_path, change, message):
    with pytest.raises(SlimkitError) as error:
        validate(glue_recipe(tmp_path, **change), "r.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_task_sets_the_evaluation_and_calibration_defaults(tmp_path):
    recipe = validate(glue_recipe(tmp_path, eval={}, calibration={"dataset": "glue", "examples": 64}), "r.yaml")
    assert recipe.eval.perplexity is None and recipe.eval.glue.task == "sst2" and recipe.eval.glue.limit is None
    recipe = validate(
        glue_recipe(
            tmp_path,
            stages=[{"stage": "prune", "args": {"scorer": "activation"}}],
            calibration={"dataset": "glue", "examples": 64},
        ),
        "r.yaml",
    )
    assert recipe.calibration_config().dataset == "glue-sst2" and recipe.calibration_config().examples == 64
    plain = validate(glue_recipe(tmp_path, task=None, stages=[{"stage": "lora"}], eval={}), "r.yaml")
    assert plain.eval.perplexity is not None and plain.eval.glue is None


def test_glue_recipe_end_to_end_with_glue_calibration(tmp_path, tiny_bert_dir):
    raw = glue_recipe(
        tiny_bert_dir,
        calibration={"dataset": "glue", "samples": 4, "seq_len": 32, "batch_size": 2, "examples": 32},
        target={"ratio": 0.25, "of": "mlp"},
    )
    raw["stages"] = [raw["stages"][0], {"stage": "prune_layer", "args": {"scorer": "activation"}}]
    out = tmp_path / "run"
    report = slimkit.run(raw, out).report.as_json()
    assert set(report["metrics"]) == {"glue_sst2_accuracy"} and report["evaluation"]["glue"]["examples"] == 16
    assert report["stages"]["glue_finetune"]["steps"] == 3
    assert report["calibration"]["dataset"] == "glue-sst2" and report["calibration"]["examples"] == 32
    assert 0.2 < report["target"]["achieved"] <= 0.25  # MLP channels go; the output bias stays
    model, tokenizer = slimkit.load(out / "model")
    assert isinstance(model, BertForSequenceClassification) and model.config.finetuning_task == "sst2"
    assert (
        evaluate_glue(model, tokenizer, "sst2", limit=16, batch_size=8, max_length=32)["accuracy"]
        == (report["metrics"]["glue_sst2_accuracy"])
    )


def test_cli_eval_glue(monkeypatch, capsys, tmp_path, tokenizer):
    model = task_model(tiny_bert(vocab_size=len(tokenizer)), "mrpc")
    slimkit.save(model, tokenizer, tmp_path / "m")
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "eval",
        str(tmp_path / "m"),
        "--glue",
        "mrpc",
        "--limit",
        "8",
        "--json",
        str(tmp_path / "r"),
    )
    assert code == 0, err
    metrics = json.loads((tmp_path / "r").read_text())["metrics"]
    assert set(metrics) == {"glue_mrpc_accuracy", "glue_mrpc_f1"} and "glue_mrpc_f1" in out
    code, _out, err = run_cli(monkeypatch, capsys, "eval", str(tmp_path / "m"), "--glue", "mnli")
    assert_one_line_error(code, err, "unknown GLUE task 'mnli'")
