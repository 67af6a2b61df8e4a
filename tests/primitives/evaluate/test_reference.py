"""The dense comparison's cache (:mod:`slimkit.primitives.evaluate.reference`): keyed by the source's content, its
entries read as untrusted input, and no cache problem ever raised (a note, then measured again or not stored)."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
from pathlib import Path

import numpy
import pytest
import torch

from slimkit.primitives.datasets.data_paths import cache_root, datasets_cache
from slimkit.primitives.errors import SlimkitError
from slimkit.primitives.evaluate import reference
from slimkit.primitives.evaluate.reference import (
    CACHE_FOLDER,
    CACHE_FORMAT,
    cache_key,
    content_fingerprint,
    dense_metrics,
    file_digest,
)

METRICS = {"wikitext2_ppl": 12.5}


class Measure:
    """A stand-in evaluation that counts its calls."""

    def __init__(self, metrics: dict[str, float] = METRICS) -> None:
        self.calls, self.metrics = 0, metrics

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return dict(self.metrics)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\x01" * 4096)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def identity_of(folder: Path) -> dict:
    return {"files": content_fingerprint(folder), "device": "cpu", "dtype": "float32", "eval": {"x": 1}}


def entry_path(identity: dict) -> Path:
    stored = json.loads(json.dumps({"format": CACHE_FORMAT, **identity}, default=str))
    return cache_root() / CACHE_FOLDER / f"{cache_key(stored)}.json"


def test_fingerprint_is_the_content_hash(source):
    import hashlib

    fingerprint = content_fingerprint(source)
    assert fingerprint == [
        ["config.json", 23, hashlib.sha256(b'{"model_type": "llama"}').hexdigest()],
        ["model.safetensors", 4096, hashlib.sha256(b"\x01" * 4096).hexdigest()],
    ]
    assert content_fingerprint(None) == [] and content_fingerprint(source / "missing") == []


def test_a_second_comparison_reads_the_cache(source):
    measure = Measure()
    first, use = dense_metrics(identity_of(source), measure)
    assert (first, use.cached, use.notes, measure.calls) == (METRICS, False, [], 1)
    second, use = dense_metrics(identity_of(source), measure)
    assert (second, use.cached, use.notes, measure.calls) == (METRICS, True, [], 1)


def test_weights_rewritten_with_their_time_kept_are_measured_again(source):
    """touch -r, tar, rsync -a and container layers keep the modification time: the key is the content."""
    weights = source / "model.safetensors"
    dense_metrics(identity_of(source), Measure())
    before = weights.stat()
    weights.write_bytes(b"\x02" * 4096)  # same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    measure = Measure({"wikitext2_ppl": 99.0})
    metrics, use = dense_metrics(identity_of(source), measure)
    assert (metrics, use.cached, measure.calls) == ({"wikitext2_ppl": 99.0}, False, 1)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"identity": null, "metrics": {"wikitext2_ppl": NaN}}', "stored for other settings"),
        (None, "not a finite number"),  # NaN with the right identity
        ("1e999", "not a finite number"),
        ("[1, 2]", "holds no mapping"),
        ("null", "holds no mapping"),
        ('"12.5"', "not a finite number"),
        ("true", "not a finite number"),
        ("deep", "nested more than"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_bad_entry_is_measured_again_and_replaced(source, content, why):
    identity = identity_of(source)
    path = entry_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored_identity = json.loads(json.dumps({"format": CACHE_FORMAT, **identity}))
    if content is None:
        text = json.dumps({"identity": stored_identity, "metrics": {"wikitext2_ppl": float("nan")}})
    elif content == "deep":
        text = json.dumps({"identity": stored_identity, "metrics": {"a": 1.0}, "x": [[[[[]]]]]}).replace(
            "[[[[[]]]]]", "[" * 200 + "]" * 200
        )
    elif content.startswith("{not") or content.startswith('{"identity": null'):
        text = content
    else:
        text = '{"identity": ' + json.dumps(stored_identity) + ', "metrics": {"wikitext2_ppl": ' + content + "}}"
        if content in ("[1, 2]", "null"):
            text = '{"identity": ' + json.dumps(stored_identity) + ', "metrics": ' + content + "}"
    path.write_text(text)
    measure = Measure()
    metrics, use = dense_metrics(identity, measure)
    assert (metrics, use.cached, measure.calls) == (METRICS, False, 1)
    assert len(use.notes) == 1 and why in use.notes[0] and "measured again" in use.notes[0]
    assert json.loads(path.read_text())["metrics"] == METRICS  # our own damaged entry, replaced
    assert dense_metrics(identity, measure)[1].cached


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "link-to-good-entry", "folder", "huge"])
def test_an_entry_that_is_not_a_plain_file_is_never_read_or_replaced(source, tmp_path, kind):
    identity = identity_of(source)
    path = entry_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero-link":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-good-entry":
        good = tmp_path / "elsewhere.json"
        good.write_text(
            json.dumps(
                {
                    "identity": json.loads(json.dumps({"format": CACHE_FORMAT, **identity})),
                    "metrics": {"wikitext2_ppl": 1.0},
                }
            )
        )
        path.symlink_to(good)
    elif kind == "folder":
        path.mkdir()
    else:
        with path.open("wb") as handle:
            handle.truncate(reference.MAX_ENTRY_BYTES + 1)
    before = os.lstat(path)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=dense_metrics(identity, Measure())), daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "reading the cache blocked"
    metrics, use = result["out"]
    assert (metrics, use.cached) == (METRICS, False)
    assert "ignored" in use.notes[0] and "measured again" in use.notes[0]
    if kind != "huge":  # a planted link, FIFO or folder stays as it was; nothing is written through it
        assert os.lstat(path).st_ino == before.st_ino and "not cached" in use.notes[-1]


def test_an_unusable_cache_folder_leaves_the_metrics_measured(source, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(blocker))
    measure = Measure()
    metrics, use = dense_metrics(identity_of(source), measure)
    assert (metrics, use.cached, measure.calls) == (METRICS, False, 1)
    assert use.notes == [
        f"dense comparison measured, not cached: SLIMKIT_CACHE_DIR {blocker} is not a folder; "
        "point SLIMKIT_CACHE_DIR at a folder slimkit may write"
    ]
    assert blocker.read_text() == "not a folder"


def test_a_blocked_or_full_cache_folder_is_a_note(source, monkeypatch):
    (cache_root() / CACHE_FOLDER).write_text("in the way")  # the entries' folder is a file
    metrics, use = dense_metrics(identity_of(source), Measure())
    assert metrics == METRICS and not use.cached
    assert "not cached: cannot write" in use.notes[0]
    (cache_root() / CACHE_FOLDER).unlink()

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(Path, "write_text", full)
        metrics, use = dense_metrics(identity_of(source), Measure())
    assert metrics == METRICS and "No space left on device" in use.notes[0]
    folder = cache_root() / CACHE_FOLDER
    assert [p.name for p in folder.iterdir()] == []  # no partial file left


def test_cache_root_refuses_a_file_in_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "cachefile"
    blocker.write_text("x")
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(blocker))
    with pytest.raises(SlimkitError, match=r"^SLIMKIT_CACHE_DIR .*cachefile is not a folder"):
        cache_root()
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(blocker / "below"))
    with pytest.raises(SlimkitError, match=r"cannot be created \(Not a directory\)"):
        cache_root()
    with pytest.raises(SlimkitError, match="SLIMKIT_CACHE_DIR"):
        datasets_cache()


def test_datasets_cache_lives_under_the_slimkit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path / "c"))
    assert datasets_cache() == tmp_path / "c" / "datasets" and datasets_cache().is_dir()


def test_file_digest_never_reads_a_fifo(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(SlimkitError, match="not a regular file"):
        file_digest(fifo)
    assert content_fingerprint(tmp_path) == [["model.safetensors", "not a regular file"]]


def test_a_large_files_digest_is_remembered_until_it_changes(source, monkeypatch):
    weights = source / "model.safetensors"
    monkeypatch.setattr(reference, "MEMO_MIN_BYTES", 1024)
    hashed: list[str] = []
    real = reference.file_digest
    monkeypatch.setattr(reference, "file_digest", lambda path: hashed.append(Path(path).name) or real(path))
    first = content_fingerprint(source)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert content_fingerprint(source) == first and hashed == ["config.json"]  # the large one remembered
    stamp = weights.stat()
    weights.write_bytes(b"\x03" * 4096)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # the modification time restored
    hashed.clear()
    changed = content_fingerprint(source)
    assert "model.safetensors" in hashed and changed != first


def test_a_planted_digest_memo_is_not_trusted(source, monkeypatch):
    monkeypatch.setattr(reference, "MEMO_MIN_BYTES", 1024)
    truth = content_fingerprint(source)
    memo = cache_root() / CACHE_FOLDER / reference.DIGEST_FOLDER
    (entry,) = memo.iterdir()
    stored = json.loads(entry.read_text())
    entry.write_text(json.dumps({**stored, "sha256": "not-a-digest"}))
    assert content_fingerprint(source) == truth
    entry.unlink()
    os.mkfifo(entry)
    assert content_fingerprint(source) == truth and entry.is_fifo()


def test_cache_key_depends_on_the_content_not_the_key_order() -> None:
    assert reference.cache_key({"a": 1, "b": [2, 3]}) == cache_key({"b": [2, 3], "a": 1})
    assert reference.cache_key({"a": 1}) != reference.cache_key({"a": 2})
    assert len(reference.cache_key({})) == 32


def test_kept_random_state_restores_every_generator() -> None:
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    expected = (random.random(), numpy.random.rand(), torch.rand(1).item())
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    with reference.kept_random_state():
        random.seed(9)
        numpy.random.seed(9)
        torch.manual_seed(9)
        random.random(), numpy.random.rand(), torch.rand(1)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == expected
