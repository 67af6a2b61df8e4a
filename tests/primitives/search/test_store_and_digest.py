"""The library's store (``primitives/search/store.py``) and the content keys (``primitives/search/digest.py``)."""

from __future__ import annotations

import torch

from slimkit.primitives.search.candidates import CandidateSpec
from slimkit.primitives.search.digest import RollingDigest
from slimkit.primitives.search.record import CandidateRecord
from slimkit.primitives.search.store import LibraryStore
from tests.tiny import tiny_llama


def _record() -> CandidateRecord:
    return CandidateRecord(
        1,
        CandidateSpec("mlp", "channels", 2),
        {"kept": [0, 3]},
        {"mlp.down_proj.weight": torch.arange(6.0).reshape(3, 2), "mlp.up_proj.weight": torch.ones(2, 3)},
        {"total": 12, "mlp": 12},
        48,
        2,
        8,
    )


def test_a_candidate_and_a_score_come_back_as_written(tmp_path):
    store = LibraryStore(tmp_path)
    store.write_candidate("k1", _record())
    back = store.read_candidate("k1")
    assert back is not None and back.spec == CandidateSpec("mlp", "channels", 2)
    assert back.structure == {"kept": [0, 3]} and back.removed == {"total": 12, "mlp": 12}
    assert torch.equal(back.tensors["mlp.down_proj.weight"], torch.arange(6.0).reshape(3, 2))
    store.write_score("s1", 0.25)
    assert store.read_score("s1") == 0.25
    assert store.read_candidate("absent") is None and store.read_score("absent") is None and not store.notes


def test_a_damaged_entry_is_ignored_with_a_note(tmp_path):
    store = LibraryStore(tmp_path)
    store.write_candidate("k1", _record())
    path = tmp_path / "candidates" / "k1.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"  # the last float changed: the tensors no longer match their digest
    path.write_bytes(bytes(data))
    assert store.read_candidate("k1") is None
    assert "do not match their recorded digest" in store.notes[-1]
    path.write_bytes(b"not a safetensors file")
    assert store.read_candidate("k1") is None and "cannot be read" in store.notes[-1]
    (tmp_path / "scores").mkdir()
    (tmp_path / "scores" / "s1.json").write_text('{"kl": -1}')
    assert store.read_score("s1") is None and "no finite, non-negative score" in store.notes[-1]


def test_no_store_keeps_nothing():
    store = LibraryStore(None)
    store.write_candidate("k1", _record())
    assert store.read_candidate("k1") is None


def test_a_layers_key_covers_it_and_what_comes_before_it_only():
    model = tiny_llama(layers=3)
    tokens = torch.randint(3, 300, (2, 8))
    layers = list(model.model.layers)
    before = RollingDigest(model, layers, tokens)
    keys = [before.layer_key(i) for i in range(3)]
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] += 1.0
    after = RollingDigest(model, layers, tokens)
    assert [after.layer_key(i) for i in range(2)] == keys[:2] and after.layer_key(2) != keys[2]
    assert after.model_key() == after.layer_key(2)
    other_tokens = RollingDigest(model, layers, tokens + 1)
    assert other_tokens.layer_key(0) != after.layer_key(0)


def test_the_same_tensors_under_another_config_key_differently():
    """A Mistral and a Llama with equal tensors compute other outputs (here: another RoPE base); a key that saw the
    tensors only would hand one the other's candidates."""
    model = tiny_llama(layers=2)
    tokens = torch.randint(3, 300, (2, 8))
    layers = list(model.model.layers)
    key = RollingDigest(model, layers, tokens).layer_key(0)
    model.config.rope_theta = model.config.to_dict().get("rope_theta", 10000.0) * 2
    model.config.rope_parameters = {**(model.config.rope_parameters or {}), "rope_theta": 123.0}
    changed = RollingDigest(model, layers, tokens).layer_key(0)
    assert changed != key
    model.config._name_or_path = "elsewhere"  # where it was read from does not change what it computes
    assert RollingDigest(model, layers, tokens).layer_key(0) == changed
