"""Helpers of the hostile-input suite (``tests/test_hostile.py``): model folders to damage, and a file-tree
checksum that never opens what it must not (FIFOs, devices) and does not follow symbolic links."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

import slimkit
from slimkit.primitives.arch import ModelView
from slimkit.primitives.lowrank import LowRankLinear
from tests.recipes.test_recipes import tiny_recipe
from tests.tiny import bpe_tokenizer, tiny_llama


def tree_checksum(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """``{relative path: digest}`` of everything under ``root`` except the relative paths in ``skip`` (and what
    is under them): a regular file's SHA-256, a symbolic link's target, a folder, or another kind by its type."""
    sums: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            relative = str(path.relative_to(root))
            if any(relative == s or relative.startswith(s + os.sep) for s in skip):
                continue
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                sums[relative] = "link:" + os.readlink(path)
            elif stat.S_ISREG(mode):
                sums[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                sums[relative] = f"mode:{stat.S_IFMT(mode)}"
    return sums


def plain_model(root: Path, name: str = "model") -> Path:
    """A plain Hugging Face folder (tiny llama + BPE tokenizer) at ``root / name``."""
    tokenizer = bpe_tokenizer()
    path = root / name
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sharded_model(root: Path, name: str = "sharded") -> Path:
    """A plain folder whose weights are split into shards named by ``model.safetensors.index.json``."""
    tokenizer = bpe_tokenizer()
    path = root / name
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(path, max_shard_size="40KB")
    tokenizer.save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file()
    return path


def low_rank_model(root: Path, name: str = "low-rank") -> Path:
    """A slimkit folder whose layer-0 q projection is a rank-4 pair (manifest ``modules[0]``)."""
    tokenizer = bpe_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    layer = ModelView(model).layer(0)
    layer.set_linear("q", LowRankLinear.from_linear(layer.linear("q"), 4))
    return slimkit.save(model, tokenizer, root / name)


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def nested_json(depth: int) -> str:
    """A JSON object nested ``depth`` levels deep."""
    return '{"model_type": "llama", "a": ' + "[" * depth + "]" * depth + "}"


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def weights_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def recipe_file(root: Path, model: Path | str = "unused", name: str = "recipe.yaml", **changes) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(tiny_recipe(model, **changes)))
    return path


def copy_model(template: Path, root: Path, name: str = "model") -> Path:
    return Path(shutil.copytree(template, root / name, symlinks=True))


__all__ = [
    "copy_model",
    "edit_json",
    "low_rank_model",
    "nested_json",
    "plain_model",
    "recipe_file",
    "sharded_model",
    "tree_checksum",
    "weights_of",
    "write_weights",
]
