"""primitives/evaluate/reference.py: the dense model's metrics, measured once per source and settings, then cached."""

from __future__ import annotations

import random

import numpy
import torch

from slimkit.primitives.evaluate.reference import cache_key, dense_metrics, kept_random_state, source_fingerprint


def test_source_fingerprint_lists_the_files_of_the_folder(tmp_path) -> None:
    (tmp_path / "b.bin").write_bytes(b"12345")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    names = [(name, size) for name, size, _mtime in source_fingerprint(tmp_path)]
    assert names == [("a.json", 2), ("b.bin", 5)]  # sorted, files only
    assert source_fingerprint(None) == [] and source_fingerprint(tmp_path / "missing") == []


def test_cache_key_depends_on_the_content_not_the_key_order() -> None:
    assert cache_key({"a": 1, "b": [2, 3]}) == cache_key({"b": [2, 3], "a": 1})
    assert cache_key({"a": 1}) != cache_key({"a": 2})
    assert len(cache_key({})) == 32


def test_dense_metrics_are_measured_once_then_read(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path))
    calls = []

    def measure() -> dict[str, float]:
        calls.append(1)
        return {"wikitext2_ppl": 12.5}

    identity = {"source": "tiny", "eval": {"seq_len": 32}}
    assert dense_metrics(identity, measure) == ({"wikitext2_ppl": 12.5}, False)
    assert dense_metrics(identity, measure) == ({"wikitext2_ppl": 12.5}, True)
    assert len(calls) == 1
    assert dense_metrics({**identity, "dtype": "bfloat16"}, measure)[1] is False  # other settings: measured
    assert len(calls) == 2


def test_kept_random_state_restores_every_generator() -> None:
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    expected = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    with kept_random_state():
        random.seed(9)
        numpy.random.seed(9)
        torch.manual_seed(9)
        random.random(), numpy.random.rand(), torch.rand(1)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == expected
