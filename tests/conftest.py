"""Shared fixtures: tiny randomly initialised models (llama with GQA, OPT, BERT) and a byte tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch

from tests.tiny import byte_tokenizer, tiny_bert, tiny_llama, tiny_opt


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SLIMKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "slimkit-cache"))
    torch.manual_seed(0)


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def opt():
    return tiny_opt()


@pytest.fixture
def bert():
    return tiny_bert()


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


def saved_tiny_llama(folder, tokenizer):
    """A tiny llama sized for ``tokenizer``, saved with it as a plain HF folder at ``folder``."""
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def tiny_llama_dir(tmp_path, tokenizer):
    """A tiny llama with a byte tokenizer saved as a plain HF folder (a local model source)."""
    return saved_tiny_llama(tmp_path / "tiny-llama", tokenizer)


def mark_folder(items, folder, *marks):
    """Add ``marks`` to every collected test under ``folder`` (how a tier folder's conftest marks its tests)."""
    for item in items:
        if folder in item.path.parents:
            for mark in marks:
                item.add_marker(mark)
